"""Preprocessing speed: tools/preprocess_data.py against a Megatron-LM-style pipeline, side by side.

The baseline reproduces how Megatron-LM's tools/preprocess_data.py works: a multiprocessing pool
over lines, json.loads, a pure-Python byte-level BPE (OpenAI's encoder.py algorithm, with its word
cache), and megatron-core's IndexedDatasetBuilder. Both run as separate processes on the same demo
corpus (stdlib docstrings, repeated --repeat times), with 1 and 2 workers; outputs are checked to be
byte-identical, then docs/s, MB/s and the speed ratio are printed.

    python benchmarks/bench_preprocess.py [--repeat 3] [--workers 1 2]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def baseline(input_path: str, prefix: str, vocab: str, merges: str, workers: int) -> None:
    """Megatron-LM's flow with a pure-Python BPE (runs in its own process)."""
    import multiprocessing as mp

    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from megatron_patch.data.tokenizers.python_bpe import PythonBPE

    global _BPE, _EOD
    _BPE = PythonBPE(vocab, merges)
    _EOD = _BPE.encoder["<|endoftext|>"]
    builder = IndexedDatasetBuilder(prefix + "_text_document.bin", dtype=np.uint16)
    with open(input_path, encoding="utf-8") as fin, mp.get_context("fork").Pool(workers) as pool:
        for ids in pool.imap(_encode_line, fin, 32):
            builder.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)])
    builder.finalize(prefix + "_text_document.idx")


def _encode_line(line: str):
    return _BPE.encode(json.loads(line)["text"]) + [_EOD]


def run(cmd) -> float:
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3, help="corpus = demo corpus repeated this many times")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--_baseline", nargs=5, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a._baseline:
        inp, prefix, vocab, merges, workers = a._baseline
        baseline(inp, prefix, vocab, merges, int(workers))
        return

    from megatron_patch.demo.corpus import build_demo_corpus
    from megatron_patch.data.train_tokenizer import train

    tmp = tempfile.mkdtemp(prefix="bench_preprocess_")
    demo = os.path.join(tmp, "demo.jsonl")
    build_demo_corpus(demo, 100_000_000)
    corpus = os.path.join(tmp, "corpus.jsonl")
    with open(demo) as f:
        text = f.read()
    with open(corpus, "w") as f:
        f.write(text * a.repeat)
    vocab, merges = train("gpt2", [demo], tmp, 8000, "gpt2")
    docs = text.count("\n") * a.repeat
    mb = os.path.getsize(corpus) / 1e6
    print(f"corpus: {docs} documents, {mb:.2f} MB (stdlib docstrings x{a.repeat}); GPT-2 BPE, vocab 8000; {os.cpu_count()} CPUs")

    rows = []
    for w in a.workers:
        ours_prefix, base_prefix = os.path.join(tmp, f"ours{w}"), os.path.join(tmp, f"base{w}")
        t_ours = run([sys.executable, "tools/preprocess_data.py", "--input", corpus, "--output-prefix", ours_prefix,
                      "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges,
                      "--append-eod", "--workers", str(w), "--log-interval", "0"])
        t_base = run([sys.executable, __file__, "--_baseline", corpus, base_prefix, vocab, merges, str(w)])
        same = all(open(ours_prefix + "_text_document" + e, "rb").read() == open(base_prefix + "_text_document" + e, "rb").read()
                   for e in (".bin", ".idx"))
        rows.append((w, t_ours, t_base, same))

    print(f"\n{'workers':>7} | {'tool':<34} | {'seconds':>7} | {'docs/s':>8} | {'MB/s':>6} | {'speed-up':>8}")
    print("-" * 86)
    for w, t_ours, t_base, same in rows:
        print(f"{w:>7} | {'Megatron-LM-style pure-Python BPE':<34} | {t_base:7.2f} | {docs / t_base:8.0f} | {mb / t_base:6.2f} | {'1.00x':>8}")
        print(f"{w:>7} | {'megatron_patch preprocess_data.py':<34} | {t_ours:7.2f} | {docs / t_ours:8.0f} | {mb / t_ours:6.2f} | {t_base / t_ours:7.2f}x")
        print(f"{'':>7} | outputs byte-identical: {same}")
    print("\n(wall time of each command, process start-up and imports included)")


if __name__ == "__main__":
    main()
