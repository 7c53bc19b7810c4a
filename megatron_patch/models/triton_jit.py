"""Triton kernels decorated on first use, once per TRITON_INTERPRET setting.

triton.jit reads TRITON_INTERPRET when it decorates a function, and the tests set it after triton is imported
(megatron-core imports it early). So the project's kernels stay plain functions at import and are decorated here
when first launched; models/triton_cross_entropy.py's docstring lists the interpreter's other limits.
"""
from __future__ import annotations

from typing import Callable, Dict, Tuple

_JITTED: Dict[Tuple[bool, Callable], object] = {}


def jit(fn: Callable):
    """`fn` decorated with triton.jit for the current TRITON_INTERPRET setting (made once per setting)."""
    import triton
    from triton import knobs

    key = (bool(knobs.runtime.interpret), fn)
    if key not in _JITTED:
        _JITTED[key] = triton.jit(fn)
    return _JITTED[key]
