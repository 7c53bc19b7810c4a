"""megatron-core's torch_dist checkpoint writer, as the engine uses it: synchronous saves.

Called by the checkpointing code (not applied globally): `write_results_in_process` before each torch_dist save
(training/checkpoint/torch_dist.py).
"""
from __future__ import annotations

import queue

from .registry import register


@register(upstream=("megatron/core/dist_checkpointing/strategies/filesystem_async.py:get_write_results_queue",
                    "megatron/core/dist_checkpointing/strategies/filesystem_async.py:FileSystemWriterAsync.prepare_write_data",
                    "megatron/core/dist_checkpointing/strategies/filesystem_async.py:"
                    "FileSystemWriterAsync.write_preloaded_data_multithread",
                    "megatron/core/dist_checkpointing/strategies/filesystem_async.py:"
                    "FileSystemWriterAsync.retrieve_write_results"),
          fixes="the torch_dist writer hands each save's write results back through a multiprocessing Manager queue "
                "(made for saves that run in another process, the async ones), whose server megatron-core spawns at "
                "a process's first save: a fresh Python that imports torch to unpickle the results, seconds per rank "
                "and one more process each. The engine saves synchronously, the results put and read in the writing "
                "process: give the writer a queue of this process instead (the same put and get_nowait)",
          fingerprint="708effab2a474003")
def write_results_in_process() -> None:
    """Make the torch_dist writer's results queue (megatron-core caches one per process) a `queue.Queue` of this
    process, unless it already made one. For synchronous saves only: an async save's worker process could not
    reach it (the engine never saves asynchronously)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
