"""JSONL corpora -> Megatron .bin/.idx, with Megatron-LM's `tools/preprocess_data.py` interface.

Output: `{output_prefix}_{key}_{document|sentence}.bin/.idx` for each `--json-keys` key (`sentence`
with `--split-sentences`). Documents are tokenized in chunks by a pool of `--workers` processes and
written in input order, so the files are byte-identical whatever `--workers` and `--partitions` are.

Nothing is dropped silently: a line that is not UTF-8, not JSON, not an object, or lacks a key stops
the run with file:line and the fix (or, with `--skip-bad-lines`, is counted and reported); documents
that tokenize to nothing and blank lines are skipped, counted and reported. Any error (bad input, bad
flags, a failing worker) prints one message and exits 1, and publishes no file: outputs are written
as `.tmp` and renamed only at the end. An input that yields no document at all is such an error.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import itertools
import json
import multiprocessing as mp
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np

from .indexed_dataset import IndexedDatasetWriter, optimal_dtype
from .sentences import split_sentences
from .tokenizers import TOKENIZER_TYPES, TokenizerError, build_tokenizer

CHUNK_LINES = 512
CHUNK_BYTES = 1 << 20
IN_FLIGHT_PER_WORKER = 2  # chunks submitted ahead per worker: keeps workers busy, memory bounded


class PreprocessError(Exception):
    """Bad input or flags. The message names the file:line (or the flag) and the fix; `main` prints it and exits 1."""


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parse Megatron-LM's preprocess_data.py flags (`argv`, default sys.argv)."""
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
        names = glob.glob(os.path.join(spec, "*.json")) + glob.glob(os.path.join(spec, "*.jsonl"))
        files = sorted(f for f in names if os.path.isfile(f))
    elif os.path.isfile(spec):
        files = [spec]
    else:
        files = sorted(f for f in glob.glob(spec) if os.path.isfile(f))
    if not files:
        raise PreprocessError(f"--input {spec}: no such file, and no .json/.jsonl files match it")
    return files


Chunk = Tuple[str, int, List[bytes]]  # path, line number of the first line, raw (undecoded) lines


def iter_chunks(files: List[str]) -> Iterator[Chunk]:
    """Raw lines of every file in bounded chunks that never cross a file boundary.

    Lines stay bytes here: the encoder decodes each one by itself, so a line that is not UTF-8 is
    reported with its exact number (or skipped with --skip-bad-lines) like any other bad line.
    """
    for path in files:
        try:
            with open(path, "rb") as f:
                start, lines, size = 1, [], 0
                for lineno, line in enumerate(f, 1):
                    lines.append(line)
                    size += len(line)
                    if len(lines) >= CHUNK_LINES or size >= CHUNK_BYTES:
                        yield path, start, lines
                        start, lines, size = lineno + 1, [], 0
                if lines:
                    yield path, start, lines
        except OSError as e:
            raise PreprocessError(f"--input {path}: cannot read it ({e.strerror or e})") from None


@dataclass
class KeyResult:
    tokens: np.ndarray
    lengths: np.ndarray
    seqs_per_doc: np.ndarray
    empty: List[int]  # line numbers of documents that tokenized to nothing


@dataclass
class ChunkResult:
    path: str
    lines: int = 0
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
        """Build the tokenizer; TokenizerError or PreprocessError name the flag at fault."""
        a = self.args
        self.tokenizer = build_tokenizer(a.tokenizer_type, a.vocab_file, a.merge_file, a.tokenizer_model, a.vocab_size)
        self.dtype = optimal_dtype(self.tokenizer.vocab_size)
        self.eod = None
        if a.append_eod:
            try:
                self.eod = self.tokenizer.eod
            except NotImplementedError as e:
                raise PreprocessError(f"--append-eod: {e}; drop --append-eod or choose a tokenizer that has one") from None

    def encode(self, chunk: Chunk) -> ChunkResult:
        """Decode, parse and tokenize the lines of `chunk`; bad lines are recorded, not raised."""
        if self.tokenizer is None:
            self.initialize()
        path, start, lines = chunk
        keys = self.args.json_keys
        res = ChunkResult(path, lines=len(lines))
        docs: List[Tuple[int, Dict[str, str]]] = []
        for lineno, raw in enumerate(lines, start):
            res.nbytes += len(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                res.bad.append((lineno, f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line: "
                                        f"{e.reason}); re-encode the file as UTF-8"))
                continue
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
            res.keys[key] = self._encode_key(path, key, [(n, d[key]) for n, d in docs])
        return res

    def _encode_key(self, path: str, key: str, docs: List[Tuple[int, str]]) -> KeyResult:
        a = self.args
        if a.split_sentences:
            pieces = [split_sentences(text, a.keep_newlines) for _, text in docs]
        else:
            pieces = [[text] for _, text in docs]
        texts = list(itertools.chain.from_iterable(pieces))
        try:
            flat_ids = self.tokenizer.tokenize_batch(texts) if texts else []
        except Exception:
            self._raise_at_failing_line(path, key, docs, pieces)
            raise  # no single text fails on its own: let the batch error through as it is
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

    def _raise_at_failing_line(self, path: str, key: str, docs: List[Tuple[int, str]], pieces: List[List[str]]) -> None:
        """A batch failed: tokenize its texts one by one to name the line at fault (raises PreprocessError)."""
        for (lineno, _), sents in zip(docs, pieces):
            for text in sents:
                try:
                    self.tokenizer.tokenize(text)
                except TokenizerError as e:
                    raise PreprocessError(f"{path}:{lineno}: key {key!r}: {e}") from None
                except Exception as e:
                    raise PreprocessError(
                        f"{path}:{lineno}: key {key!r}: the {self.args.tokenizer_type} failed on this text "
                        f"({type(e).__name__}: {e})"
                    ) from None


_ENCODER: Optional[Encoder] = None


def _worker_init(args: argparse.Namespace) -> None:
    global _ENCODER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    _ENCODER = Encoder(args)
    _ENCODER.initialize()


def _worker_encode(chunk: Chunk) -> ChunkResult:
    return _ENCODER.encode(chunk)


def _encode_all(args: argparse.Namespace, chunks: Iterable[Chunk]) -> Iterator[ChunkResult]:
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
def _writers(prefixes: Dict[str, str], dtype) -> Iterator[Dict[str, IndexedDatasetWriter]]:
    """One writer per key; a writer not finalized when the block ends is aborted (its .tmp removed)."""
    with contextlib.ExitStack() as stack:
        yield {k: stack.enter_context(IndexedDatasetWriter(p, dtype)) for k, p in prefixes.items()}


def _run(args: argparse.Namespace, chunks: Iterable[Chunk], writers: Dict[str, IndexedDatasetWriter],
         totals: Totals, t0: float) -> None:
    """Encode `chunks` into `writers` (left unfinalized); the first bad line stops it unless --skip-bad-lines."""
    next_log = args.log_interval
    with contextlib.closing(_encode_all(args, chunks)) as results:
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


def _require_documents(args: argparse.Namespace, files: List[str], totals: Totals) -> None:
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


def _run_partitions(args: argparse.Namespace, files: List[str], prefixes: Dict[str, str], dtype,
                    totals: Totals, t0: float) -> None:
    """--partitions N: each contiguous part is written to its own pair, then all are merged; part files never outlive the run."""
    part_prefixes: List[Dict[str, str]] = []
    try:
        for i, part in enumerate(_partition(files, args.partitions)):
            part_prefixes.append({k: f"{p}_part{i}" for k, p in prefixes.items()})
            with _writers(part_prefixes[-1], dtype) as writers:
                _run(args, part, writers, totals, t0)
                for w in writers.values():
                    w.finalize()
        _require_documents(args, files, totals)
        with _writers(prefixes, dtype) as writers:
            for k, w in writers.items():
                for pp in part_prefixes:
                    w.add_index(pp[k])
                w.finalize()
    finally:
        for path in (pp[k] + ext for pp in part_prefixes for k in pp for ext in (".bin", ".idx")):
            if os.path.exists(path):
                os.remove(path)


def preprocess(args: argparse.Namespace) -> Totals:
    """Run the whole conversion; return the counts (also printed). Bad input or flags raise PreprocessError."""
    files = resolve_inputs(args.input)
    probe = Encoder(args)
    try:
        probe.initialize()  # fail on a bad tokenizer flag before any work starts
    except TokenizerError as e:
        raise PreprocessError(str(e)) from None
    prefixes = output_prefixes(args)
    totals = Totals()
    t0 = time.time()
    if args.partitions == 1:
        with _writers(prefixes, probe.dtype) as writers:
            _run(args, iter_chunks(files), writers, totals, t0)
            _require_documents(args, files, totals)
            for w in writers.values():
                w.finalize()
    else:
        _run_partitions(args, files, prefixes, probe.dtype, totals, t0)
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
    """Command-line entry point: an error in the input or the flags prints one message and exits 1."""
    try:
        preprocess(get_args(argv))
    except (PreprocessError, TokenizerError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
