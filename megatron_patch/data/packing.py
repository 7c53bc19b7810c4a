"""Packing documents into token budgets and bucketing samples by length.

The work is done by the C++ helpers in csrc/packing.cpp (megatron_patch._C, built at install). The
`*_reference` functions are the plain-Python definitions of the same results; the tests check the two
agree element for element and benchmarks/bench_packing.py measures the speed-up.
"""
from __future__ import annotations

import bisect
from typing import List, Tuple

import numpy as np

from megatron_patch import _C


def pack_documents(lengths, capacity: int) -> np.ndarray:
    """Bin id of each document under best-fit-decreasing packing into bins of `capacity` tokens.

    Documents are taken longest first (ties: lower index first); each goes into the open bin with
    the least room that still fits it (ties: the earliest bin), else into a new bin. A document
    longer than `capacity` is an error: truncate first.
    """
    return _C.pack_best_fit_decreasing(np.asarray(lengths, dtype=np.int64), int(capacity))


def bucket_by_length(lengths, max_tokens: int, multiple: int = 8, max_batch_size: int = 0) -> List[np.ndarray]:
    """Batches of sample indices whose padded size fits `max_tokens`.

    Samples are sorted by (length, index); a batch grows while (size + 1) * round_up(longest, multiple)
    <= max_tokens and size < max_batch_size (0: no cap). A sample longer than max_tokens alone still
    forms a batch of one.
    """
    order, offsets = _C.bucket_by_length(np.asarray(lengths, dtype=np.int64), int(max_tokens), int(multiple), int(max_batch_size))
    return [order[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]


def bins_to_groups(bins: np.ndarray) -> List[np.ndarray]:
    """Document indices of each bin, in bin order (documents in index order within a bin)."""
    order = np.argsort(bins, kind="stable")
    counts = np.bincount(bins) if len(bins) else np.zeros(0, np.int64)
    return np.split(order, np.cumsum(counts)[:-1]) if len(bins) else []


def pack_documents_reference(lengths, capacity: int) -> np.ndarray:
    """Plain-Python best-fit decreasing; same result as `pack_documents`."""
    lengths = [int(x) for x in lengths]
    for i, n in enumerate(lengths):
        if n < 0 or n > capacity:
            raise ValueError(f"document {i} has length {n}, outside [0, capacity={capacity}]")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep index order
    room: List[Tuple[int, int]] = []  # sorted (remaining, bin id)
    bins = [0] * len(lengths)
    next_bin = 0
    for doc in order:
        need = lengths[doc]
        k = bisect.bisect_left(room, (need, -1))
        if k == len(room):
            bin_id, left = next_bin, capacity - need
            next_bin += 1
        else:
            left, bin_id = room.pop(k)
            left -= need
        bisect.insort(room, (left, bin_id))
        bins[doc] = bin_id
    return np.asarray(bins, dtype=np.int64)


def bucket_by_length_reference(lengths, max_tokens: int, multiple: int = 8, max_batch_size: int = 0) -> List[np.ndarray]:
    """Plain-Python length bucketing; same result as `bucket_by_length`."""
    lengths = [int(x) for x in lengths]
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: List[List[int]] = []
    for i in order:
        padded = -(-lengths[i] // multiple) * multiple
        if batches and (
            (len(batches[-1]) + 1) * padded <= max_tokens and (max_batch_size <= 0 or len(batches[-1]) < max_batch_size)
        ):
            batches[-1].append(i)
        else:
            batches.append([i])
    return [np.asarray(b, dtype=np.int64) for b in batches]
