"""C++ best-fit-decreasing packing and length bucketing against their plain-Python references.

    python benchmarks/bench_packing.py [--docs 1000000] [--capacity 2048]

Document lengths are drawn from the demo corpus's real tokenized lengths (resampled to --docs).
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def timed(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t, out


def real_lengths(n: int, seed: int = 0) -> np.ndarray:
    """Token lengths of the demo corpus documents (GPT-2 BPE trained on it), resampled to n."""
    import json
    import tempfile

    from megatron_patch.demo.corpus import build_demo_corpus
    from megatron_patch.data.tokenizers import build_tokenizer
    from megatron_patch.data.train_tokenizer import train

    tmp = tempfile.mkdtemp()
    build_demo_corpus(f"{tmp}/c.jsonl", 100_000_000)
    vocab, merges = train("gpt2", [f"{tmp}/c.jsonl"], tmp, 8000, "gpt2")
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    texts = [json.loads(line)["text"] for line in open(f"{tmp}/c.jsonl")]
    lengths = np.array([len(x) + 1 for x in tok.tokenize_batch(texts)])
    return np.random.default_rng(seed).choice(lengths, n)


def main() -> None:
    from megatron_patch.data.packing import (
        bucket_by_length, bucket_by_length_reference, pack_documents, pack_documents_reference,
    )

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=1_000_000)
    p.add_argument("--capacity", type=int, default=2048)
    a = p.parse_args()
    lengths = np.minimum(real_lengths(a.docs), a.capacity)
    print(f"{a.docs} documents, lengths from the demo corpus: mean {lengths.mean():.0f}, max {lengths.max()}, "
          f"capacity {a.capacity}")
    rows = []
    t_c, bins_c = timed(pack_documents, lengths, a.capacity)
    t_py, bins_py = timed(pack_documents_reference, lengths, a.capacity)
    n_bins = int(bins_c.max()) + 1
    rows.append(("pack (best-fit decreasing)", t_py, t_c, np.array_equal(bins_c, bins_py),
                 f"{n_bins} bins, fill {lengths.sum() / (n_bins * a.capacity):.4f}"))
    budget = 8 * a.capacity
    t_c, b_c = timed(bucket_by_length, lengths, budget, 8)
    t_py, b_py = timed(bucket_by_length_reference, lengths, budget, 8)
    same = len(b_c) == len(b_py) and all(np.array_equal(x, y) for x, y in zip(b_c, b_py))
    rows.append(("bucket by length (multiple 8)", t_py, t_c, same, f"{len(b_c)} batches"))
    print(f"\n{'helper':<30} | {'python s':>9} | {'C++ s':>7} | {'speed-up':>8} | equal | result")
    print("-" * 90)
    for name, t_py, t_c, eq, what in rows:
        print(f"{name:<30} | {t_py:9.2f} | {t_c:7.3f} | {t_py / t_c:7.0f}x | {str(eq):<5} | {what}")


if __name__ == "__main__":
    main()
