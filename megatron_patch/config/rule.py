"""The rule table's frame: a `Check` (name, concern, function Config -> refusal or None), the table `CHECKS` that
`@rule(concern)` fills, and the environment probes rules share (a GPU, Triton). The rules themselves are in
checks_layout.py and checks_training.py; checks.py runs them."""
from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, List, Optional

if TYPE_CHECKING:
    from .config import Config


@dataclass(frozen=True)
class Check:
    name: str
    concern: str
    fn: Callable[["Config"], Optional[str]]


CHECKS: List[Check] = []


def rule(concern: str):
    """Register the decorated function (Config -> refusal or None) as a check of `concern`."""
    def register(fn):
        CHECKS.append(Check(fn.__name__, concern, fn))
        return fn
    return register


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _triton_interpret() -> bool:
    """TRITON_INTERPRET as Triton itself reads it (1, true, on, yes, ...)."""
    from triton import knobs

    return bool(knobs.runtime.interpret)


def triton_missing(flag: str, missing: str, no_gpu: str) -> Optional[str]:
    """Why Triton kernels cannot run here (the package, and a GPU or Triton's interpreter), or None."""
    if importlib.util.find_spec("triton") is None:
        return (f"{flag} needs the triton package (it comes with torch's CUDA wheels), which is not installed: install "
                f"it, or {missing}")
    if not _has_gpu() and not _triton_interpret():
        return (f"{flag} runs Triton kernels, which need a CUDA GPU; this machine has none. On the CPU set "
                f"TRITON_INTERPRET=1 in the environment (Triton's interpreter: correct but slow, for tests), or {no_gpu}")
    return None



@functools.lru_cache(maxsize=1)
def transformer_engine_available() -> bool:
    """Whether Transformer Engine imports (megatron-core probes it the same way: installed but broken counts as
    absent); once per process, so the checks pay for the import at most once."""
    try:
        import transformer_engine  # noqa: F401

        return True
    except Exception:
        return False
