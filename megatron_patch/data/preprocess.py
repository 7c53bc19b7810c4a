"""JSONL corpora -> Megatron .bin/.idx, with Megatron-LM's `tools/preprocess_data.py` interface.

Output: `{output_prefix}_{key}_{document|sentence}.bin/.idx` for each `--json-keys` key (`sentence`
with `--split-sentences`). Documents are tokenized in chunks by a pool of `--workers` processes and
written in input order, so the files are byte-identical whatever `--workers` and `--partitions` are.

Nothing is dropped silently: a line that is not JSON, is not an object, or lacks a key stops the run
with file:line and the fix (or, with `--skip-bad-lines`, is counted and reported); documents that
tokenize to nothing and blank lines are skipped, counted and reported.
"""
from __future__ import annotations

import argparse
import glob
import itertools
import json
import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from .indexed_dataset import IndexedDatasetWriter, optimal_dtype
from .sentences import split_sentences
from .tokenizers import TOKENIZER_TYPES, build_tokenizer

CHUNK_LINES = 512
CHUNK_BYTES = 1 << 20


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Tokenize JSONL into Megatron .bin/.idx files.")
    g = p.add_argument_group("input data")
    g.add_argument("--input", required=True, help="JSONL file, directory of .json/.jsonl files, or glob")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract (default: text)")
    g.add_argument("--split-sentences", action="store_true",
                   help="split documents into sentences (offline rule-based splitter, megatron_patch.data.sentences)")
    g.add_argument("--keep-newlines", action="store_true", help="keep newlines inside sentences when splitting")
    g.add_argument("--skip-bad-lines", action="store_true",
                   help="skip lines that are not JSON objects with the keys (counted and reported) instead of stopping")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--vocab-file", "--vocab", dest="vocab_file", default=None, help="vocab.json (GPT-2) or vocab.txt (BERT)")
    g.add_argument("--merge-file", default=None, help="merges.txt (GPT-2)")
    g.add_argument("--tokenizer-model", default=None, help="SentencePiece .model file or Hugging Face tokenizer directory")
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer only")
    g.add_argument("--append-eod", action="store_true", help="append the end-of-document token to every document")
    g = p.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="path prefix of the output files")
    g.add_argument("--dataset-impl", default="mmap", choices=["mmap"], help="only Megatron's mmap format is written")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    g.add_argument("--partitions", type=int, default=1,
                   help="process the input in this many contiguous parts, each written to its own pair and merged at the end")
    g.add_argument("--log-interval", type=int, default=1000, help="report docs/s and MB/s every this many documents")
    a = p.parse_args(argv)
    if a.workers < 1:
        p.error("--workers must be at least 1")
    if a.partitions < 1:
        p.error("--partitions must be at least 1")
    if a.keep_newlines and not a.split_sentences:
        print("note: --keep-newlines only matters with --split-sentences; documents always keep their newlines",
              file=sys.stderr)
    return a


def resolve_inputs(spec: str) -> List[str]:
    """Input files of `--input`: a file, a directory (its .json/.jsonl files) or a glob; sorted."""
    if os.path.isdir(spec):
        files = sorted(glob.glob(os.path.join(spec, "*.json")) + glob.glob(os.path.join(spec, "*.jsonl")))
    elif os.path.isfile(spec):
        files = [spec]
    else:
        files = sorted(f for f in glob.glob(spec) if os.path.isfile(f))
    if not files:
        raise SystemExit(f"--input {spec}: no such file, and no .json/.jsonl files match it")
    return files


Chunk = Tuple[str, int, List[str]]  # path, line number of the first line, raw lines


def iter_chunks(files: List[str]) -> Iterator[Chunk]:
    """Lines of every file in bounded chunks that never cross a file boundary."""
    for path in files:
        with open(path, encoding="utf-8", errors="strict") as f:
            start, lines, size = 1, [], 0
            lineno = 0
            try:
                for lineno, line in enumerate(f, 1):
                    lines.append(line)
                    size += len(line)
                    if len(lines) >= CHUNK_LINES or size >= CHUNK_BYTES:
                        yield path, start, lines
                        start, lines, size = lineno + 1, [], 0
            except UnicodeDecodeError as e:
                raise SystemExit(f"{path}:{lineno + 1}: not valid UTF-8 ({e.reason}); re-encode the file as UTF-8") from None
            if lines:
                yield path, start, lines


@dataclass
class KeyResult:
    tokens: np.ndarray
    lengths: np.ndarray
    seqs_per_doc: np.ndarray
    empty: List[int]  # line numbers of documents that tokenized to nothing


@dataclass
class ChunkResult:
    path: str
    docs: int = 0
    nbytes: int = 0
    blank: int = 0
    bad: List[Tuple[int, str]] = field(default_factory=list)
    keys: Dict[str, KeyResult] = field(default_factory=dict)


class Encoder:
    """Turns a chunk of raw JSONL lines into token arrays, one tokenizer per process."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tokenizer = None

    def initialize(self) -> None:
        a = self.args
        self.tokenizer = build_tokenizer(a.tokenizer_type, a.vocab_file, a.merge_file, a.tokenizer_model, a.vocab_size)
        self.dtype = optimal_dtype(self.tokenizer.vocab_size)
        self.eod = self.tokenizer.eod if a.append_eod else None

    def encode(self, chunk: Chunk) -> ChunkResult:
        if self.tokenizer is None:
            self.initialize()
        path, start, lines = chunk
        keys = self.args.json_keys
        res = ChunkResult(path)
        docs: List[Tuple[int, Dict[str, str]]] = []
        for lineno, line in enumerate(lines, start):
            res.nbytes += len(line.encode("utf-8"))
            if not line.strip():
                res.blank += 1
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                res.bad.append((lineno, f"not valid JSON ({e.msg} at column {e.colno})"))
                continue
            if not isinstance(obj, dict):
                res.bad.append((lineno, f"a JSON {type(obj).__name__}, not an object"))
                continue
            missing = [k for k in keys if not isinstance(obj.get(k), str)]
            if missing:
                k = missing[0]
                why = "has no key" if k not in obj else f"has a {type(obj[k]).__name__}, not a string, under key"
                res.bad.append((lineno, f"{why} {k!r} (keys present: {', '.join(sorted(obj)) or 'none'})"))
                continue
            docs.append((lineno, {k: obj[k] for k in keys}))
        res.docs = len(docs)
        for key in keys:
            res.keys[key] = self._encode_key([(n, d[key]) for n, d in docs])
        return res

    def _encode_key(self, docs: List[Tuple[int, str]]) -> KeyResult:
        a = self.args
        if a.split_sentences:
            pieces = [split_sentences(text, a.keep_newlines) for _, text in docs]
        else:
            pieces = [[text] for _, text in docs]
        flat_ids = self.tokenizer.tokenize_batch(list(itertools.chain.from_iterable(pieces))) if docs else []
        seqs: List[List[int]] = []
        seqs_per_doc: List[int] = []
        empty: List[int] = []
        pos = 0
        for (lineno, _), sents in zip(docs, pieces):
            ids = [s for s in flat_ids[pos : pos + len(sents)] if s]
            pos += len(sents)
            if not ids:
                empty.append(lineno)
                continue
            if self.eod is not None:
                ids[-1] = list(ids[-1]) + [self.eod]
            seqs.extend(ids)
            seqs_per_doc.append(len(ids))
        lengths = np.fromiter((len(s) for s in seqs), dtype=np.int32, count=len(seqs))
        tokens = np.fromiter(itertools.chain.from_iterable(seqs), dtype=self.dtype, count=int(lengths.sum()))
        return KeyResult(tokens, lengths, np.asarray(seqs_per_doc, dtype=np.int64), empty)


_ENCODER: Optional[Encoder] = None


def _worker_init(args: argparse.Namespace) -> None:
    global _ENCODER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    _ENCODER = Encoder(args)
    _ENCODER.initialize()


def _worker_encode(chunk: Chunk) -> ChunkResult:
    return _ENCODER.encode(chunk)


def output_prefixes(args: argparse.Namespace) -> Dict[str, str]:
    level = "sentence" if args.split_sentences else "document"
    return {k: f"{args.output_prefix}_{k}_{level}" for k in args.json_keys}


@dataclass
class Totals:
    docs: int = 0
    nbytes: int = 0
    blank: int = 0
    tokens: int = 0
    bad: List[Tuple[str, int, str]] = field(default_factory=list)
    empty: List[Tuple[str, int, str]] = field(default_factory=list)


def _partition(files: List[str], n: int) -> List[List[Chunk]]:
    """Split the chunk stream into n contiguous, nearly equal parts (by chunk count)."""
    chunks = list(iter_chunks(files)) if n > 1 else None
    if chunks is None:
        return []
    size = -(-len(chunks) // n) if chunks else 1
    return [chunks[i : i + size] for i in range(0, len(chunks), size)] or [[]]


def _run(args: argparse.Namespace, chunks, prefixes: Dict[str, str], dtype, totals: Totals, t0: float) -> None:
    writers = {k: IndexedDatasetWriter(p, dtype) for k, p in prefixes.items()}
    pool = None
    try:
        if args.workers > 1:
            ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context("spawn")
            pool = ctx.Pool(args.workers, initializer=_worker_init, initargs=(args,))
            results = pool.imap(_worker_encode, chunks)
        else:
            encoder = Encoder(args)
            results = map(encoder.encode, chunks)
        next_log = args.log_interval
        for r in results:
            if r.bad and not args.skip_bad_lines:
                lineno, why = r.bad[0]
                raise SystemExit(
                    f"{r.path}:{lineno}: {why}. Each line must be a JSON object with the string key(s) "
                    f"{', '.join(args.json_keys)} (see --json-keys); fix the line, or pass --skip-bad-lines "
                    f"to skip and count such lines."
                )
            totals.bad.extend((r.path, n, why) for n, why in r.bad)
            totals.docs += r.docs
            totals.nbytes += r.nbytes
            totals.blank += r.blank
            for key, kr in r.keys.items():
                writers[key].add_documents(kr.tokens, kr.lengths, kr.seqs_per_doc)
                totals.tokens += len(kr.tokens)
                totals.empty.extend((r.path, n, key) for n in kr.empty)
            if args.log_interval and totals.docs >= next_log:
                dt = max(time.time() - t0, 1e-9)
                print(f"processed {totals.docs} documents ({totals.docs / dt:.0f} docs/s, "
                      f"{totals.nbytes / dt / 1e6:.2f} MB/s)", file=sys.stderr, flush=True)
                next_log = (totals.docs // args.log_interval + 1) * args.log_interval
        for w in writers.values():
            w.finalize()
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    finally:
        if pool is not None:
            pool.terminate()


def preprocess(args: argparse.Namespace) -> Totals:
    """Run the whole conversion; return the counts (also printed)."""
    files = resolve_inputs(args.input)
    probe = Encoder(args)
    probe.initialize()  # fail on a bad tokenizer flag before any work starts
    dtype = probe.dtype
    prefixes = output_prefixes(args)
    totals = Totals()
    t0 = time.time()
    if args.partitions == 1:
        _run(args, iter_chunks(files), prefixes, dtype, totals, t0)
    else:
        parts = _partition(files, args.partitions)
        part_prefixes = []
        for i, part in enumerate(parts):
            pp = {k: f"{p}_part{i}" for k, p in prefixes.items()}
            _run(args, iter(part), pp, dtype, totals, t0)
            part_prefixes.append(pp)
        for k, p in prefixes.items():
            w = IndexedDatasetWriter(p, dtype)
            for pp in part_prefixes:
                w.add_index(pp[k])
            w.finalize()
            for pp in part_prefixes:
                os.remove(pp[k] + ".bin")
                os.remove(pp[k] + ".idx")
    dt = max(time.time() - t0, 1e-9)
    print(f"done: {totals.docs} documents read, {totals.tokens} tokens written, {totals.nbytes / 1e6:.2f} MB in {dt:.2f} s "
          f"({totals.docs / dt:.0f} docs/s, {totals.nbytes / dt / 1e6:.2f} MB/s) with {args.workers} worker(s)",
          file=sys.stderr)
    if totals.bad:
        path, n, why = totals.bad[0]
        print(f"skipped {len(totals.bad)} bad line(s) (--skip-bad-lines); first: {path}:{n}: {why}", file=sys.stderr)
    if totals.empty:
        path, n, key = totals.empty[0]
        print(f"skipped {len(totals.empty)} empty document(s) that tokenized to nothing; first: {path}:{n} key {key!r}",
              file=sys.stderr)
    if totals.blank:
        print(f"skipped {totals.blank} blank line(s)", file=sys.stderr)
    for k, p in prefixes.items():
        print(f"wrote {p}.bin and {p}.idx", file=sys.stderr)
    return totals


def main(argv: Optional[List[str]] = None) -> None:
    preprocess(get_args(argv))


if __name__ == "__main__":
    main()
