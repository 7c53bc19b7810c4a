"""GPT-2 byte-level BPE from vocab.json + merges.txt, run by the Rust `tokenizers` library.

Configured to give the ids of OpenAI's encoder.py (which Megatron-LM's GPT2BPETokenizer uses):
GPT-2's pre-tokenisation regex, byte-level alphabet, no prefix space, and `<|endoftext|>` treated as
ordinary text inside documents (it is only *appended* as the end-of-document id).
"""
from __future__ import annotations

import json
from typing import Dict, List, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from .base import AbstractTokenizer

EOD_TOKEN = "<|endoftext|>"


def _check_file(path: str, flag: str) -> None:
    import os

    if not path:
        raise ValueError(f"GPT2BPETokenizer needs {flag}: pass {flag} PATH (see tools/train_tokenizer.py to make one)")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{flag} {path}: no such file")


class GPT2BPETokenizer(AbstractTokenizer):
    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        self.source = {"vocab_file": vocab_file, "merge_file": merge_file}
        _check_file(vocab_file, "--vocab-file")
        _check_file(merge_file, "--merge-file")
        with open(vocab_file, encoding="utf-8") as f:
            self._vocab: Dict[str, int] = json.load(f)
        self._tok = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        self._tok.decoder = decoders.ByteLevel()
        if EOD_TOKEN not in self._vocab:
            raise ValueError(f"--vocab-file {vocab_file} has no {EOD_TOKEN!r} entry, which GPT-2 vocabularies use as end of document")
        self._eod = self._vocab[EOD_TOKEN]
        self._batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)

    def tokenize(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [e.ids for e in self._batch(list(texts), add_special_tokens=False)]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    @property
    def vocab(self) -> Dict[str, int]:
        return self._vocab

    @property
    def eod(self) -> int:
        return self._eod
