"""Checks on training data made when it is opened, before any sample is drawn: each failure is one
`DataError` naming the file, the fault and the likely fix, instead of a hang or an IndexError deep inside
a training step.

Light on purpose (numpy only): `pretrain_megatron_gpt.py --validate-only`, which the launchers run before
torchrun, imports it without megatron-core or torch.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
from typing import List, Optional, Sequence, Tuple

import numpy as np

from .indexed_dataset import IndexedDataset, bin_path, idx_path

Blend = Tuple[List[str], Optional[List[float]]]

# Tokens scanned per numpy call: bounds the temporary memory of a min/max over a huge memory map.
_CHUNK = 1 << 26


class DataError(ValueError):
    """Training data that cannot be used as given; the message names the file and the fix."""


class MissingDataError(DataError, FileNotFoundError):
    """A --data-path prefix whose .idx/.bin files do not exist (also a FileNotFoundError, as before)."""


def parse_data_path(data_path: Sequence[str]) -> Blend:
    """`--data-path a` / `a b` (weights from sizes) / `0.3 a 0.7 b` -> (prefixes, weights or None).

    Every prefix must name an existing .idx/.bin pair."""
    items = list(data_path)
    if not items:
        raise DataError("--data-path is empty: give a prefix (made by tools/preprocess_data.py) or 'w1 p1 w2 p2 ...'")

    def is_number(s: str) -> bool:
        try:
            float(s)
            return True
        except ValueError:
            return False

    if len(items) == 1 or not is_number(items[0]):
        prefixes, weights = items, None
    else:
        if len(items) % 2:
            raise DataError(f"--data-path {' '.join(items)}: weighted blends come in pairs 'weight prefix ...'")
        weights = [float(w) for w in items[0::2]]
        prefixes = items[1::2]
        if any(w < 0 for w in weights) or sum(weights) <= 0:
            raise DataError(f"--data-path weights {weights} must be non-negative and not all zero")
    for p in prefixes:
        if not os.path.isfile(idx_path(p)):
            raise MissingDataError(f"--data-path {p}: {_where(idx_path(p))} not found; {_missing_hint(p)}")
        if not os.path.isfile(bin_path(p)):
            raise MissingDataError(f"--data-path {p}: {bin_path(p)} not found next to {idx_path(p)}; copy the .bin too")
    return prefixes, weights


def _where(path: str) -> str:
    return path if os.path.isabs(path) else f"{path} ({os.path.abspath(path)})"


def _missing_hint(prefix: str) -> str:
    if prefix.endswith((".bin", ".idx")):
        return f"pass the prefix without .bin/.idx: {prefix[:-4]}"
    near = sorted(glob.glob(glob.escape(prefix) + "*.idx"))[:3]  # e.g. 'corpus' for 'corpus_text_document'
    if near:
        return "did you mean " + " or ".join(n[:-4] for n in near) + "?"
    return "tools/preprocess_data.py --output-prefix X writes X_text_document.bin/.idx: pass that prefix"


def _token_range(path: str, dtype: np.dtype) -> Tuple[int, int]:
    """(smallest, largest) token id in a .bin; (0, -1) when it holds no tokens."""
    if os.path.getsize(path) == 0:
        return 0, -1
    tokens = np.memmap(path, dtype=dtype, mode="r")
    lo, hi = None, None
    for start in range(0, len(tokens), _CHUNK):
        part = tokens[start:start + _CHUNK]
        a, b = int(part.min()), int(part.max())
        lo, hi = a if lo is None else min(lo, a), b if hi is None else max(hi, b)
    return lo, hi


def _cache_file(cache_dir: str, path: str) -> str:
    key = hashlib.md5(os.path.abspath(path).encode()).hexdigest()[:12]
    return os.path.join(cache_dir, "token_ranges", f"{os.path.basename(path)}.{key}.json")


def token_range(prefix: str, cache_dir: Optional[str] = None) -> Tuple[int, int]:
    """(smallest, largest) token id of prefix.bin. With `cache_dir`, the answer is kept there, keyed by the
    file's size and modification time, so a large corpus is scanned once (a scan reads about 4 GB/s from
    the page cache; the demo's 1 MB takes 5 ms)."""
    return _cached_range(bin_path(prefix), IndexedDataset(prefix).dtype, cache_dir)


def _cached_range(path: str, dtype: np.dtype, cache_dir: Optional[str]) -> Tuple[int, int]:
    st = os.stat(path)
    stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "dtype": str(dtype)}
    cache = _cache_file(cache_dir, path) if cache_dir else None
    if cache and os.path.isfile(cache):
        try:
            with open(cache) as f:
                saved = json.load(f)
            if all(saved.get(k) == v for k, v in stamp.items()):
                return saved["min"], saved["max"]
        except (OSError, ValueError, KeyError):
            pass  # unreadable cache: scan again
    lo, hi = _token_range(path, dtype)
    if cache:
        try:  # only a cache: a read-only location costs a rescan next time, nothing else
            os.makedirs(os.path.dirname(cache), exist_ok=True)
            tmp = f"{cache}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(dict(stamp, min=lo, max=hi), f)
            os.replace(tmp, cache)
        except OSError:
            pass
    return lo, hi


def _first_outside(ds: IndexedDataset, vocab_size: int) -> str:
    """Where the first id outside 0..vocab_size-1 sits, in words (only called once one is known to exist)."""
    tokens = np.memmap(bin_path(ds.prefix), dtype=ds.dtype, mode="r")
    for start in range(0, len(tokens), _CHUNK):
        part = tokens[start:start + _CHUNK]
        bad = np.flatnonzero((part >= vocab_size) | (part < 0))
        if len(bad):
            offset = start + int(bad[0])
            ends = np.cumsum(ds.sequence_lengths, dtype=np.int64)
            seq = int(np.searchsorted(ends, offset, side="right"))
            doc = int(np.searchsorted(ds.document_indices, seq, side="right")) - 1
            return f"first at token {offset} (id {int(part[bad[0]])}, document {doc})"
    return "position not found"


def check_token_ids(prefixes: Sequence[str], vocab_size: int, cache_dir: Optional[str] = None) -> int:
    """Every token id of every prefix must be a row of the embedding (0 <= id < vocab_size); returns the
    largest id seen (-1 when nothing needed a scan). An id outside the vocabulary would otherwise fail
    inside a training step's embedding lookup ('index out of range in self'), far from its cause."""
    largest = -1
    for p in prefixes:
        ds = IndexedDataset(p)  # also refuses a truncated or corrupt pair, in words
        info = np.iinfo(ds.dtype) if np.issubdtype(ds.dtype, np.integer) else None
        if info is not None and info.min >= 0 and info.max < vocab_size:
            continue  # e.g. uint16 data with a vocabulary of 65,536 or more: every id it can hold fits
        lo, hi = _cached_range(bin_path(p), ds.dtype, cache_dir)
        if hi >= vocab_size:
            raise DataError(
                f"{bin_path(p)}: largest token id {hi} is outside the tokenizer's vocabulary of {vocab_size} "
                f"(ids 0..{vocab_size - 1}), {_first_outside(ds, vocab_size)}; the data was probably made with "
                f"another tokenizer: pass the --tokenizer-type/--vocab-file/--merge-file/--tokenizer-model it was "
                f"preprocessed with, or preprocess it again with this one")
        if lo < 0:
            raise DataError(f"{bin_path(p)}: negative token id {lo}, {_first_outside(ds, vocab_size)}; the file "
                            f"does not hold token ids (corrupt, or written with another dtype)")
        largest = max(largest, hi)
    return largest


def split_bounds(split: str) -> List[Tuple[float, float]]:
    """megatron-core's split arithmetic: '969,30,1' -> normalized cumulative (begin, end) per split."""
    weights = [float(x) for x in split.replace("/", ",").split(",")]
    weights = (weights + [0.0] * 3)[:3]
    total = sum(weights)
    bounds, lo = [], 0.0
    for w in weights:
        bounds.append((lo, lo + w / total))
        lo += w / total
    return bounds


def check_split_sizes(prefixes: Sequence[str], split: str) -> None:
    """Each split given a weight in --split must receive tokens from every file: megatron-core's GPTDataset
    loops forever counting epochs over a split with none (a small file with --split 969,30,1)."""
    names = ("training", "validation", "test")
    for p in prefixes:
        ds = IndexedDataset(p)
        lengths = ds.sequence_lengths
        for name, (lo, hi) in zip(names, split_bounds(split)):
            if hi <= lo:
                continue  # weight 0: megatron-core builds no such split
            beg, end = int(round(lo * len(lengths))), int(round(hi * len(lengths)))
            if int(lengths[beg:end].sum(dtype=np.int64)) == 0:
                raise DataError(
                    f"{bin_path(p)}: --split {split} leaves the {name} split of its {len(lengths)} sequences "
                    f"({end - beg} of them, sequences {beg}..{end}) without tokens; give that split a weight "
                    f"of 0 (e.g. --split 99,1,0), raise its share, or use more data")


def check_bert_documents(prefixes: Sequence[str], split: str, binary_head: bool = True) -> None:
    """Every split with a weight in --split must hold a document BERT can sample from: two or more sentences
    for next-sentence prediction (one with --bert-no-binary-head). megatron-core's BERT dataset splits by
    document and skips the others, so data tokenized without --split-sentences (one sequence per document)
    would leave it nothing to sample."""
    need = 2 if binary_head else 1
    names = ("training", "validation", "test")
    for p in prefixes:
        sentences = np.diff(IndexedDataset(p).document_indices)  # sequences (sentences) per document
        if binary_head and len(sentences) and not (sentences >= 2).any():
            raise DataError(
                f"{idx_path(p)}: every document is a single sequence, so next-sentence prediction has no sentence "
                f"pairs; preprocess with tools/preprocess_data.py --split-sentences (its output is "
                f"PREFIX_text_sentence), or pass --bert-no-binary-head")
        for name, (lo, hi) in zip(names, split_bounds(split)):
            if hi <= lo:
                continue
            beg, end = int(round(lo * len(sentences))), int(round(hi * len(sentences)))
            if not (sentences[beg:end] >= need).any():
                what = "with two or more sentences" if binary_head else "with a sentence"
                raise DataError(
                    f"{idx_path(p)}: --split {split} gives the {name} split documents {beg}..{end} of "
                    f"{len(sentences)}, none {what}; give that split a weight of 0 (e.g. --split 99,1,0), raise "
                    f"its share, or use more data")
