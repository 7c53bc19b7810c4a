"""NullTokenizer: the text is already token ids separated by whitespace, as for Megatron-LM's NullTokenizer."""
from __future__ import annotations

from typing import Dict, List, Sequence

from .base import AbstractTokenizer, TokenizerError


class NullTokenizer(AbstractTokenizer):
    name = "NullTokenizer"

    def __init__(self, vocab_size: int) -> None:
        if not vocab_size or vocab_size <= 0:
            raise TokenizerError("NullTokenizer needs --vocab-size N (the largest id in the data plus one)")
        self._n = int(vocab_size)

    def tokenize(self, text: str) -> List[int]:
        pieces = text.split()
        try:
            ids = [int(x) for x in pieces]
        except ValueError:
            # Name the first piece that is not an id: ordinary text here means the wrong --tokenizer-type.
            bad = next(x for x in pieces if not _is_int(x))
            raise TokenizerError(
                f"NullTokenizer reads text that is already token ids separated by whitespace (e.g. '17 4 902'), "
                f"but found {bad[:40]!r}; for ordinary text choose a real --tokenizer-type (e.g. GPT2BPETokenizer)"
            ) from None
        bad_ids = [i for i in ids if not 0 <= i < self._n]
        if bad_ids:
            raise TokenizerError(f"NullTokenizer: id {bad_ids[0]} is outside [0, {self._n}); raise --vocab-size")
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


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True
