"""megatron-core's torch_dist checkpoint writer, as the engine uses it: in the saving process (synchronous saves, and
--async-save's background thread).

Called by the checkpointing code (not applied globally): `write_results_in_process` before each torch_dist save
(training/checkpoint/torch_dist.py), `staged_async_write` for each asynchronous one (training/checkpoint/async_save.py).
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
    process, unless it already made one. The engine's saves, --async-save's included, write from this process (a
    thread for the asynchronous ones), never from megatron-core's worker process, which could not reach it."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


@register(upstream=("megatron/core/dist_checkpointing/strategies/async_utils.py:AsyncRequest.execute_sync",
                    "megatron/core/dist_checkpointing/strategies/filesystem_async.py:"
                    "FileSystemWriterAsync.get_save_function_and_args",
                    "megatron/core/dist_checkpointing/strategies/filesystem_async.py:FileSystemWriterAsync.preload_tensors"),
          fixes="an asynchronous torch_dist save stages the tensors to write with `tensor.to('cpu')` (preload_tensors), "
                "which on a CPU run returns the live parameters and optimizer state themselves: training would change "
                "them while the background writer reads them. Stage copies instead (`to('cpu', copy=True)`: one D2H "
                "copy on a GPU as before, a clone on the CPU), in the request's argument slot execute_sync fills",
          fingerprint="6f323e27efea9cc2")
def staged_async_write(request) -> tuple:
    """(function, args, kwargs) that write an AsyncRequest's files (megatron-core's threads, no process), its
    tensors staged as copies now: the caller may run it in a background thread while training goes on."""
    args = list(request.async_fn_args)
    if request.async_fn is None:  # nothing to write on this rank
        return None, (), {}
    buckets = args[1]
    args[1] = [(file_name, storage_key, (bytes_data, [(item, t.to("cpu", copy=True)) for item, t in tensors]))
               for file_name, storage_key, (bytes_data, tensors) in buckets]
    return request.async_fn, tuple(args), dict(request.async_fn_kwargs)
