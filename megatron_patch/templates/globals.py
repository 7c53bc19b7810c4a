"""The run's global state that the documented samples reach for: `get_args()`, `get_logger()`, `get_timers()`.

`get_args()` returns the parsed `rapidformer` flags. Inside a `rapidformer` run they are set before the
user's script starts; a script started another way (python or torchrun) gets them parsed from its own
command line the first time they are asked for.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Dict, List, Optional

from .logger import get_logger, rank  # noqa: F401  (re-exported: the samples import them from here)

_ARGS: Optional[argparse.Namespace] = None
_TIMERS: Optional["Timers"] = None


def set_args(args: argparse.Namespace) -> None:
    global _ARGS
    _ARGS = args


def get_args() -> argparse.Namespace:
    """The parsed `rapidformer` flags (parsed from sys.argv on first use outside a `rapidformer` run)."""
    global _ARGS
    if _ARGS is None:
        from megatron_patch.config.rapidformer_flags import parse_args

        from .rules import check

        _ARGS = parse_args(sys.argv[1:])
        check(_ARGS, world_size=int(os.environ.get("WORLD_SIZE", "1")))
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
