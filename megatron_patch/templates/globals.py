"""The run's global state that the documented samples reach for: `get_args()`, `get_logger()`, `get_timers()`.

`get_args()` is a view of the run's one configuration, the `rapidformer` flags as the front end parsed and
checked them before the user's script started (`set_args`, in every worker). Outside a `rapidformer` run there is
none: it says so, instead of parsing whatever command line the process happens to have.
"""
from __future__ import annotations

import argparse
import time
from typing import Dict, List, Optional

from .logger import get_logger, rank  # noqa: F401  (re-exported: the samples import them from here)

_ARGS: Optional[argparse.Namespace] = None
_TIMERS: Optional["Timers"] = None


def set_args(args: argparse.Namespace) -> None:
    global _ARGS
    _ARGS = args


def get_args() -> argparse.Namespace:
    """The `rapidformer` flags of the run under way (set by the front end before the user's script starts)."""
    if _ARGS is None:
        raise RuntimeError("get_args() returns the flags of a rapidformer run, and none is under way: start the "
                           "script with `rapidformer --user-script FILE [flags]` (or give the template its args: "
                           "RapidformerEngine(args))")
    return _ARGS


class _Timer:
    def __init__(self, name: str) -> None:
        self.name, self._start, self._elapsed = name, None, 0.0

    def start(self) -> None:
        self._start = time.perf_counter()

    def stop(self) -> None:
        if self._start is not None:
            self._elapsed += time.perf_counter() - self._start
            self._start = None

    def elapsed(self, reset: bool = True) -> float:
        running = self._start is not None
        if running:
            self.stop()
        value = self._elapsed
        if reset:
            self._elapsed = 0.0
        if running:
            self.start()
        return value


class Timers:
    """Named wall-clock timers with megatron's call style: `timers("forward").start()`, `.stop()`,
    `.elapsed()`, and `timers.log(["forward"])` for one line of milliseconds on rank 0."""

    def __init__(self) -> None:
        self._timers: Dict[str, _Timer] = {}

    def __call__(self, name: str, log_level: Optional[int] = None) -> _Timer:
        return self._timers.setdefault(name, _Timer(name))

    def log(self, names: List[str], normalizer: float = 1.0, reset: bool = True) -> str:
        line = "time (ms) | " + " | ".join(
            f"{n}: {self._timers[n].elapsed(reset) * 1000.0 / normalizer:.2f}" for n in names if n in self._timers)
        get_logger().info(line)
        return line


def get_timers() -> Timers:
    global _TIMERS
    if _TIMERS is None:
        _TIMERS = Timers()
    return _TIMERS
