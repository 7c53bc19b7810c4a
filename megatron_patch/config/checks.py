"""The engine's rules: one table of small named checks, grouped by concern, each returning its refusal (a sentence
naming the flags and the fix) or None. `run_checks` runs them in table order on a resolved Config and raises the
first refusal. They read the configuration only (and whether a GPU / Triton is there), never the file system: the
checks of --save and --load against the disk are validate.py's `check_paths`, run by the entry point."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, List, Optional

from .errors import ConfigError

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


def run_checks(c: Config, concerns: Optional[tuple] = None) -> None:
    """Raise ConfigError with the first refusal of the table (of `concerns`, default all) for `c`."""
    for check in CHECKS:
        if concerns is None or check.concern in concerns:
            refusal = check.fn(c)
            if refusal:
                raise ConfigError(refusal)


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


# Import order registers the concerns' tables in this order: layout, moe, batch, memory, precision, fusion,
# schedule, model, data, checkpoint.
from . import checks_layout, checks_training  # noqa: E402,F401  (they register their checks)
