"""Any Hugging Face tokenizer saved in a local directory (tokenizer.json / tokenizer_config.json)."""
from __future__ import annotations

import os
from typing import Dict, List, Sequence

from .base import NO_TOKEN, AbstractTokenizer, TokenizerError


class HuggingFaceTokenizer(AbstractTokenizer):
    name = "HuggingFaceTokenizer"

    def __init__(self, tokenizer_model: str) -> None:
        self.source = {"tokenizer_model": tokenizer_model}
        if not tokenizer_model or not os.path.isdir(tokenizer_model):
            raise TokenizerError(
                f"HuggingFaceTokenizer needs --tokenizer-model DIR, a local directory saved with "
                f"save_pretrained() (got {tokenizer_model!r}); nothing is downloaded from a hub"
            )
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(tokenizer_model, local_files_only=True)
        except Exception as e:  # transformers raises OSError, ValueError, KeyError... naming neither flag nor fix
            reason = " ".join(str(e).split())[:300] or type(e).__name__  # some messages span many lines
            raise TokenizerError(
                f"--tokenizer-model {tokenizer_model}: no Hugging Face tokenizer could be loaded from this directory "
                f"({reason}); it must hold the files save_pretrained() writes (tokenizer.json and tokenizer_config.json)"
            ) from e
        self._vocab = self._tok.get_vocab()

    def tokenize(self, text: str) -> List[int]:
        return self._tok(text, add_special_tokens=False, verbose=False)["input_ids"]

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return self._tok(list(texts), add_special_tokens=False, verbose=False)["input_ids"]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))

    @property
    def vocab(self) -> Dict[str, int]:
        return self._vocab

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def _id(self, attr: str) -> int:
        value = getattr(self._tok, attr, None)
        if value is None:
            raise NotImplementedError(f"the tokenizer in this directory has no {attr}")
        return value

    @property
    def eod(self) -> int:
        value = self._tok.eos_token_id if self._tok.eos_token_id is not None else self._tok.sep_token_id
        if value is None:
            raise NotImplementedError("the tokenizer in this directory has neither an eos nor a sep token")
        return value

    @property
    def pad(self) -> int:
        return self._tok.pad_token_id if self._tok.pad_token_id is not None else NO_TOKEN

    @property
    def cls(self) -> int:
        return self._id("cls_token_id")

    @property
    def sep(self) -> int:
        return self._id("sep_token_id")

    @property
    def mask(self) -> int:
        return self._id("mask_token_id")
