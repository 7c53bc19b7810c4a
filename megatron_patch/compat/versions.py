"""The versions the workarounds in megatron_patch.compat were tested with, checked once per process."""
from __future__ import annotations

import fnmatch
import warnings
from importlib import metadata
from typing import Dict, Optional

# distribution name -> the versions tested (fnmatch patterns over the base version, local suffix dropped)
TESTED: Dict[str, str] = {"megatron-core": "0.19.2", "torch": "2.11.*"}
TESTED_TEXT = ", ".join(f"{name} {spec.replace('.*', '.x')}" for name, spec in TESTED.items())

_CHECKED: Optional[bool] = None


class UntestedVersionWarning(UserWarning):
    """megatron-core or torch is a version megatron_patch.compat's workarounds were not tested with."""


def base_version(version: str) -> str:
    """'0.19.2+1b5afd9' -> '0.19.2', '2.11.0+cu130' -> '2.11.0'."""
    return version.split("+", 1)[0].strip()


def installed_versions() -> Dict[str, str]:
    out = {}
    for name in TESTED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            module = {"megatron-core": "megatron.core"}.get(name, name)
            out[name] = getattr(__import__(module, fromlist=["__version__"]), "__version__", "unknown")
    return out


def check_versions() -> bool:
    """True when the installed megatron-core and torch are the tested ones. Otherwise warn, once per process,
    with one sentence naming what was tested and what is installed. Idempotent: later calls return the
    first answer without warning again."""
    global _CHECKED
    if _CHECKED is not None:
        return _CHECKED
    installed = installed_versions()
    untested = {n: v for n, v in installed.items() if not fnmatch.fnmatchcase(base_version(v), TESTED[n])}
    _CHECKED = not untested
    if untested:
        warnings.warn(
            f"megatron_patch's workarounds for megatron-core/torch internals (megatron_patch/compat) were tested with "
            f"{TESTED_TEXT}; installed: {', '.join(f'{n} {v}' for n, v in installed.items())}. If training fails "
            f"inside megatron-core or torch, run tests/test_compat.py: its canaries name the patches whose upstream "
            f"code changed.", UntestedVersionWarning, stacklevel=2)
    return _CHECKED
