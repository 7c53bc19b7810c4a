"""Encoding every chunk in input order (preprocess.py): in this process (`--workers 1`) or in a pool of
`--workers` processes with a few chunks in flight each, a dead worker reported with the lines it held."""
from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Iterable, Iterator, Optional

from .preprocess_encode import ChunkResult, Encoder
from .preprocess_input import Chunk, PreprocessError

IN_FLIGHT_PER_WORKER = 2  # chunks submitted ahead per worker: keeps workers busy, memory bounded


_ENCODER: Optional[Encoder] = None


def _worker_init(args: argparse.Namespace) -> None:
    global _ENCODER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    _ENCODER = Encoder(args)
    _ENCODER.initialize()


def _worker_encode(chunk: Chunk) -> ChunkResult:
    return _ENCODER.encode(chunk)


def encode_all(args: argparse.Namespace, chunks: Iterable[Chunk]) -> Iterator[ChunkResult]:
    """Encoded chunks in input order, in this process (`--workers 1`) or in `--workers` processes.

    The input is read here, in the caller's thread, and only a few chunks per worker are in flight,
    so an error while reading is raised right here, and a worker's error (or its death) comes back
    from `result()`. (Through `Pool.imap` a read error died in the pool's feeder thread, and the run
    waited forever.) Close the generator to stop early: queued chunks are dropped.
    """
    if args.workers == 1:
        encoder = Encoder(args)
        for chunk in chunks:
            yield encoder.encode(chunk)
        return
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    pool = ProcessPoolExecutor(args.workers, mp_context=ctx, initializer=_worker_init, initargs=(args,))
    pending: collections.deque = collections.deque()  # (future, chunk path, first line, line count)
    try:
        for chunk in chunks:
            pending.append((pool.submit(_worker_encode, chunk), chunk[0], chunk[1], len(chunk[2])))
            if len(pending) >= IN_FLIGHT_PER_WORKER * args.workers:
                yield _result(*pending.popleft())
        while pending:
            yield _result(*pending.popleft())
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # waits only for the chunks already being encoded


def _result(future, path: str, first: int, count: int) -> ChunkResult:
    """The worker's result, its exception re-raised, or a PreprocessError naming the lines a dead worker held."""
    try:
        return future.result()
    except BrokenProcessPool:
        raise PreprocessError(
            f"{path}:{first}-{first + count - 1}: a --workers process died while encoding these lines "
            f"(killed, or out of memory?); rerun, with fewer --workers if memory is short"
        ) from None
