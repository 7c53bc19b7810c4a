"""When each training step's work ended, and how long it took.

With step metrics read one step late (loop.py), the host is often already a whole step further than the step it
finishes: CUDA's launch queue holds about a thousand kernels, so the host blocks while queueing step N+1 until the
device is nearly through it, and only then reads step N. Wall-clock time between those reads is right on average
but shifted by up to a step wherever a read is immediate (logging, saving), so a window of steps could count one
step too few. A CUDA event recorded after each step's last kernel times the device itself instead.
"""
from __future__ import annotations

import time
from typing import Union

import torch

Mark = Union[float, "torch.cuda.Event"]


class StepClock:
    """Marks the end of each step (a CUDA event on a GPU, the wall clock on the CPU, where work is synchronous)
    and gives the seconds between consecutive marks."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._last = self.mark()

    def mark(self) -> Mark:
        """A point after all work queued so far."""
        if not self.cuda:
            return time.time()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def restart(self) -> None:
        """The next step is timed from here (after an evaluation or a save, which are not a step's time)."""
        self._last = self.mark()

    def elapsed(self, end: Mark) -> float:
        """Seconds from the previous mark (or restart) to `end`, which must be the next mark in queue order; waits
        for `end` on a GPU."""
        if self.cuda:
            end.synchronize()
            seconds = self._last.elapsed_time(end) / 1000.0
        else:
            seconds = end - self._last
        self._last = end
        return seconds
