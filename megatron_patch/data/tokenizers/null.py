"""NullTokenizer: the text is already ids separated by spaces (tests and mock data)."""
from __future__ import annotations

from typing import Dict, List, Sequence

from .base import AbstractTokenizer


class NullTokenizer(AbstractTokenizer):
    name = "NullTokenizer"

    def __init__(self, vocab_size: int) -> None:
        if not vocab_size or vocab_size <= 0:
            raise ValueError("NullTokenizer needs --vocab-size N (the largest id in the data plus one)")
        self._n = int(vocab_size)

    def tokenize(self, text: str) -> List[int]:
        ids = [int(x) for x in text.split()]
        bad = [i for i in ids if not 0 <= i < self._n]
        if bad:
            raise ValueError(f"NullTokenizer: id {bad[0]} is outside [0, {self._n}); raise --vocab-size")
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    @property
    def vocab(self) -> Dict[str, int]:
        return {str(i): i for i in range(self.vocab_size)}

    @property
    def vocab_size(self) -> int:
        # One extra id past the user's range: the end-of-document token (as in Megatron-LM).
        return self._n + 1

    @property
    def eod(self) -> int:
        return self._n
