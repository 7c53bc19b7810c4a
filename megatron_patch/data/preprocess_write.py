"""Preprocessing's output (preprocess.py): the encoded chunks written into one .bin/.idx pair per key (`.tmp` until
finalized), or with `--partitions N` into a pair per part merged at the end; the counts of what was read and
skipped; and the refusal to publish a dataset without documents."""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, Iterable, Iterator, List, Tuple

from .indexed_dataset import IndexedDatasetWriter
from .preprocess_input import Chunk, PreprocessError, iter_chunks
from .preprocess_pool import encode_all


def output_prefixes(args: argparse.Namespace) -> Dict[str, str]:
    """Output prefix of each --json-keys key: {output_prefix}_{key}_{document|sentence}."""
    level = "sentence" if args.split_sentences else "document"
    return {k: f"{args.output_prefix}_{k}_{level}" for k in args.json_keys}


@dataclass
class Totals:
    lines: int = 0
    docs: int = 0
    nbytes: int = 0
    blank: int = 0
    tokens: int = 0
    bad: List[Tuple[str, int, str]] = field(default_factory=list)
    empty: List[Tuple[str, int, str]] = field(default_factory=list)
    written: Dict[str, int] = field(default_factory=dict)  # documents written, per key


def _partition(files: List[str], n: int) -> List[List[Chunk]]:
    """Split the chunk stream into n contiguous, nearly equal parts (by chunk count)."""
    chunks = list(iter_chunks(files))
    size = max(1, -(-len(chunks) // n))
    return [chunks[i : i + size] for i in range(0, len(chunks), size)] or [[]]


@contextlib.contextmanager
def open_writers(prefixes: Dict[str, str], dtype) -> Iterator[Dict[str, IndexedDatasetWriter]]:
    """One writer per key; a writer not finalized when the block ends is aborted (its .tmp removed)."""
    with contextlib.ExitStack() as stack:
        yield {k: stack.enter_context(IndexedDatasetWriter(p, dtype)) for k, p in prefixes.items()}


def write_chunks(args: argparse.Namespace, chunks: Iterable[Chunk], writers: Dict[str, IndexedDatasetWriter],
                 totals: Totals, t0: float) -> None:
    """Encode `chunks` into `writers` (left unfinalized); the first bad line stops it unless --skip-bad-lines."""
    next_log = args.log_interval
    with contextlib.closing(encode_all(args, chunks)) as results:
        for r in results:
            if r.bad and not args.skip_bad_lines:
                lineno, why = r.bad[0]
                raise PreprocessError(
                    f"{r.path}:{lineno}: {why}. Each line must be a JSON object with the string key(s) "
                    f"{', '.join(args.json_keys)} (see --json-keys); fix the line, or pass --skip-bad-lines "
                    f"to skip and count such lines."
                )
            totals.bad.extend((r.path, n, why) for n, why in r.bad)
            totals.lines += r.lines
            totals.docs += r.docs
            totals.nbytes += r.nbytes
            totals.blank += r.blank
            for key, kr in r.keys.items():
                writers[key].add_documents(kr.tokens, kr.lengths, kr.seqs_per_doc)
                totals.tokens += len(kr.tokens)
                totals.written[key] = totals.written.get(key, 0) + len(kr.seqs_per_doc)
                totals.empty.extend((r.path, n, key) for n in kr.empty)
            if args.log_interval and totals.docs >= next_log:
                dt = max(time.time() - t0, 1e-9)
                print(f"processed {totals.docs} documents ({totals.docs / dt:.0f} docs/s, "
                      f"{totals.nbytes / dt / 1e6:.2f} MB/s)", file=sys.stderr, flush=True)
                next_log = (totals.docs // args.log_interval + 1) * args.log_interval


def require_documents(args: argparse.Namespace, files: List[str], totals: Totals) -> None:
    """Refuse to publish a dataset without documents: it is never what was meant, and training would fail later."""
    keys = [k for k in args.json_keys if not totals.written.get(k)]
    if not keys:
        return
    where = ", ".join(files[:3]) + (f" and {len(files) - 3} more file(s)" if len(files) > 3 else "")
    empty = sum(1 for _, _, k in totals.empty if k in keys)
    seen = [f"{n} {what}" for n, what in ((totals.blank, "blank"), (len(totals.bad), "bad, skipped by --skip-bad-lines"),
                                          (empty, "document(s) that tokenized to nothing")) if n]
    why = f"{totals.lines} line(s) read" + (": " + ", ".join(seen) if seen else "")
    if totals.bad:
        path, n, what = totals.bad[0]
        why += f"; first bad line {path}:{n}: {what}"
    raise PreprocessError(
        f"{where}: the input produced no documents for key(s) {', '.join(map(repr, keys))} ({why}). Nothing was written; "
        f"point --input at JSONL lines that hold non-empty text under --json-keys."
    )


def write_partitions(args: argparse.Namespace, files: List[str], prefixes: Dict[str, str], dtype,
                     totals: Totals, t0: float) -> None:
    """--partitions N: each contiguous part is written to its own pair, then all are merged; part files never outlive the run."""
    part_prefixes: List[Dict[str, str]] = []
    try:
        for i, part in enumerate(_partition(files, args.partitions)):
            part_prefixes.append({k: f"{p}_part{i}" for k, p in prefixes.items()})
            with open_writers(part_prefixes[-1], dtype) as writers:
                write_chunks(args, part, writers, totals, t0)
                for w in writers.values():
                    w.finalize()
        require_documents(args, files, totals)
        with open_writers(prefixes, dtype) as writers:
            for k, w in writers.items():
                for pp in part_prefixes:
                    w.add_index(pp[k])
                w.finalize()
    finally:
        for path in (pp[k] + ext for pp in part_prefixes for k in pp for ext in (".bin", ".idx")):
            if os.path.exists(path):
                os.remove(path)
