"""A pure-Python GPT-2 byte-level BPE: the algorithm of OpenAI's encoder.py, which Megatron-LM's
GPT2BPETokenizer runs. Slow on purpose; it is the independent reference our Rust-backed
GPT2BPETokenizer is tested against, and the baseline of benchmarks/bench_preprocess.py.
"""
from __future__ import annotations

import json
from functools import lru_cache
from typing import Dict, List, Tuple

import regex

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


@lru_cache()
def byte_alphabet() -> Dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(keep, chars)}


class PythonBPE:
    """encode(text) -> ids with merges applied lowest-rank first, per pre-tokenised word."""

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        with open(vocab_file, encoding="utf-8") as f:
            self.encoder: Dict[str, int] = json.load(f)
        with open(merge_file, encoding="utf-8") as f:
            lines = [ln for ln in f.read().split("\n") if ln and not ln.startswith("#version")]
        self.ranks: Dict[Tuple[str, str], int] = {tuple(ln.split()): i for i, ln in enumerate(lines)}
        self.pattern = regex.compile(GPT2_PATTERN)
        self.alphabet = byte_alphabet()
        self.cache: Dict[str, List[str]] = {}

    def _bpe(self, word: str) -> List[str]:
        if word in self.cache:
            return self.cache[word]
        parts = list(word)
        while len(parts) > 1:
            pairs = {(parts[i], parts[i + 1]) for i in range(len(parts) - 1)}
            best = min(pairs, key=lambda p: self.ranks.get(p, float("inf")))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(parts):
                if i < len(parts) - 1 and (parts[i], parts[i + 1]) == best:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        self.cache[word] = parts
        return parts

    def encode(self, text: str) -> List[int]:
        ids: List[int] = []
        for piece in self.pattern.findall(text):
            word = "".join(self.alphabet[b] for b in piece.encode("utf-8"))
            ids.extend(self.encoder[t] for t in self._bpe(word))
        return ids
