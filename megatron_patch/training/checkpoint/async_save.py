"""`--async-save`: training goes on while a checkpoint is written.

At a save, every worker plans the checkpoint with megatron-core (dist_checkpointing.save(async_sharded_save=True):
the collectives, the common state and the write plan) and stages copies of its tensors (compat.staged_async_write:
a device-to-host copy on a GPU, a clone on the CPU); a background thread of this process then writes the files
with megatron-core's writer threads into `iter_N.tmp/`. After every iteration the workers ask each other (a gloo
all-reduce, no device synchronisation) whether all writes are done; once they are, the main threads run
megatron-core's finalisation (metadata, collective) and publish the checkpoint as a synchronous save does (manifest
last, rename to `iter_N/`, then the tracker). A worker killed during the write leaves `iter_N.tmp/` behind and the
tracker on the previous checkpoint: a resume loads that one. A save that starts while the previous one is still
being written, the end of training and --exit-interval wait for it first.

The stall of a save is its planning and staging (one copy of this rank's weights and optimizer state), not the
write. Memory: the staged copy lives on the host until its write is done.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_patch.compat.checkpoint_writer import staged_async_write
from megatron_patch.config.checkpoint_layout import CheckpointError


def _write(fn: Callable, args: tuple, kwargs: dict) -> None:
    """The background thread's work: this rank's files (tests replace it to make a write slow)."""
    fn(*args, **kwargs)


class PendingSave:
    """One checkpoint being written: its thread, megatron-core's finalisation and our publication."""

    def __init__(self, iteration: int, request, publish: Callable[[], str]) -> None:
        self.iteration, self.request, self.publish = iteration, request, publish
        self.started = time.time()
        self.error: Optional[BaseException] = None
        fn, args, kwargs = staged_async_write(request)
        self.thread = threading.Thread(target=self._run, args=(fn, args, kwargs), daemon=True,
                                       name=f"megatron_patch-async-save-{iteration}")
        self.thread.start()

    def _run(self, fn, args, kwargs) -> None:
        try:
            if fn is not None:
                _write(fn, args, kwargs)
        except BaseException as e:  # handed to the main thread by finish()
            self.error = e

    def finish(self) -> str:
        """Wait for this rank's writes, then finalise and publish (collective)."""
        self.thread.join()
        failed = torch.tensor([float(self.error is not None)])
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=_gloo())
        if failed.item():
            raise CheckpointError(f"the asynchronous save of iteration {self.iteration} failed on "
                                  f"{'this rank' if self.error else 'another rank'}"
                                  f"{f': {type(self.error).__name__}: {self.error}' if self.error else ''}; the "
                                  "previous checkpoint stays the newest")
        for fn in self.request.finalize_fns:
            fn()
        return self.publish()


_GLOO = None


def _gloo():
    """A gloo group of every rank for the 'all written?' question: no device synchronisation on a GPU."""
    global _GLOO
    if _GLOO is None:
        _GLOO = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
    return _GLOO


class AsyncSaver:
    """At most one save in flight. `start` it at a save, `poll()` after every iteration, `finish()` at the end."""

    def __init__(self) -> None:
        self.pending: Optional[PendingSave] = None
        _gloo()  # collective: made by every rank at the same point (the Checkpointer's construction)

    def start(self, iteration: int, request, publish: Callable[[], str]) -> None:
        self.finish()
        self.pending = PendingSave(iteration, request, publish)

    def poll(self) -> Optional[str]:
        """Publish the pending checkpoint if every rank has written its files (collective); its directory, or
        None."""
        if self.pending is None:
            return None
        done = torch.tensor([float(not self.pending.thread.is_alive())])
        dist.all_reduce(done, op=dist.ReduceOp.MIN, group=_gloo())
        return self.finish() if done.item() else None

    def finish(self) -> Optional[str]:
        """Wait for the pending checkpoint (if any) and publish it (collective)."""
        pending, self.pending = self.pending, None
        return pending.finish() if pending is not None else None
