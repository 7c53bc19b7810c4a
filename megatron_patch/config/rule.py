"""The rule tables' frame: a `Check` (name, concern, function -> refusal or None), `RuleTable`, the engine's table
`CHECKS` that `@rule(concern)` fills, and the environment probes rules share (a GPU, Triton). The rules themselves
are in checks_layout.py, checks_training.py and checks_bert.py; checks.py runs them."""
from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import Callable, List, Optional, Type


@dataclass(frozen=True)
class Check:
    name: str
    concern: str
    fn: Callable[..., Optional[str]]  # the inputs of its table (the engine's: a Config) -> refusal or None


class RuleTable(List[Check]):
    """A table of named rules grouped by concern, in registration order: the engine's `CHECKS` (Config -> refusal)
    and the front end's (templates/rules/table.py: the flags and the worker count -> refusal) are two of them."""

    def rule(self, concern: str):
        """Register the decorated function (the table's inputs -> refusal or None) as a check of `concern`."""
        def register(fn):
            self.append(Check(fn.__name__, concern, fn))
            return fn
        return register

    def run(self, *inputs, which: Callable[[str], bool], error: Type[Exception]) -> None:
        """Raise `error` with the first refusal of the rules whose concern `which` accepts, in table order."""
        for check in self:
            if which(check.concern):
                refusal = check.fn(*inputs)
                if refusal:
                    raise error(refusal)


CHECKS = RuleTable()
rule = CHECKS.rule  # the engine's rules register with @rule(concern)


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


def resolved_attention_backend(backend: str) -> str:
    """--attention-backend as the model is built with it: auto is te where Transformer Engine imports, else sdpa."""
    if backend == "auto":
        return "te" if transformer_engine_available() else "sdpa"
    return backend
