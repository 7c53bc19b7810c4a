"""JSONL corpora -> Megatron .bin/.idx, with Megatron-LM's `tools/preprocess_data.py` interface.

`--sft` switches to chat conversations for supervised fine-tuning (sft_preprocess.py).

Output: `{output_prefix}_{key}_{document|sentence}.bin/.idx` for each `--json-keys` key (`sentence`
with `--split-sentences`). Documents are tokenized in chunks by a pool of `--workers` processes and
written in input order, so the files are byte-identical whatever `--workers` and `--partitions` are.

Nothing is dropped silently: a line that is not UTF-8, not JSON, not an object, or lacks a key stops
the run with file:line and the fix (or, with `--skip-bad-lines`, is counted and reported); documents
that tokenize to nothing and blank lines are skipped, counted and reported. Any error (bad input, bad
flags, a failing worker) prints one message and exits 1, and publishes no file: outputs are written
as `.tmp` and renamed only at the end. An input that yields no document at all is such an error.

Here: the flags and the run. The input files and chunks are preprocess_input's, a chunk's encoding
preprocess_encode's, the worker pool preprocess_pool's, the output files preprocess_write's.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import List, Optional

from .preprocess_encode import Encoder
from .preprocess_input import PreprocessError, iter_chunks, resolve_inputs
from .preprocess_write import (Totals, open_writers, output_prefixes, require_documents, write_chunks,
                               write_partitions)
from .tokenizers import TOKENIZER_TYPES, TokenizerError


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
        with open_writers(prefixes, probe.dtype) as writers:
            write_chunks(args, iter_chunks(files), writers, totals, t0)
            require_documents(args, files, totals)
            for w in writers.values():
                w.finalize()
    else:
        write_partitions(args, files, prefixes, probe.dtype, totals, t0)
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
    """Command-line entry point: an error in the input or the flags prints one message and exits 1. With `--sft`,
    chat conversations are rendered into tokens and a loss mask instead (megatron_patch.data.sft_preprocess)."""
    if "--sft" in (sys.argv[1:] if argv is None else argv):
        from .sft_preprocess import main as sft_main

        return sft_main(argv)
    try:
        preprocess(get_args(argv))
    except (PreprocessError, TokenizerError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
