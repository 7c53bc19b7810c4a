"""GPT-2 byte-level BPE from vocab.json + merges.txt, run by the Rust `tokenizers` library.

Configured to give the ids of OpenAI's encoder.py (which Megatron-LM's GPT2BPETokenizer uses):
GPT-2's pre-tokenisation regex, byte-level alphabet, no prefix space, and `<|endoftext|>` treated as
ordinary text inside documents (it is only *appended* as the end-of-document id).
"""
from __future__ import annotations

import json
from typing import Dict, List, Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from .base import AbstractTokenizer, TokenizerError, require_file

EOD_TOKEN = "<|endoftext|>"
VOCAB_WHAT = "a GPT-2 vocab.json (a JSON object of token -> id; tools/train_tokenizer.py writes one)"
MERGES_WHAT = "a GPT-2 merges.txt (one 'left right' merge per line, saved with the vocab.json)"


def _read_vocab(path: str) -> Dict[str, int]:
    """The token -> id map of a vocab.json, or a TokenizerError that says what the file is instead."""
    try:
        with open(path, encoding="utf-8") as f:
            vocab = json.load(f)
    except UnicodeDecodeError as e:
        raise TokenizerError(f"--vocab-file {path}: not UTF-8 text (byte {e.start}: {e.reason}); pass {VOCAB_WHAT}") from None
    except json.JSONDecodeError as e:
        raise TokenizerError(
            f"--vocab-file {path}: not JSON ({e.msg} at line {e.lineno} column {e.colno}), so not a GPT-2 vocab.json; "
            f"pass {VOCAB_WHAT}, and the merges.txt as --merge-file"
        ) from None
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
        raise TokenizerError(f"--vocab-file {path}: JSON, but not an object of token -> integer id; pass {VOCAB_WHAT}")
    return vocab


class GPT2BPETokenizer(AbstractTokenizer):
    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        self.source = {"vocab_file": vocab_file, "merge_file": merge_file}
        require_file(vocab_file, "--vocab-file", self.name, VOCAB_WHAT)
        require_file(merge_file, "--merge-file", self.name, MERGES_WHAT)
        self._vocab: Dict[str, int] = _read_vocab(vocab_file)
        if EOD_TOKEN not in self._vocab:
            raise TokenizerError(f"--vocab-file {vocab_file} has no {EOD_TOKEN!r} entry, which GPT-2 vocabularies use as end of document")
        try:
            model = models.BPE.from_file(vocab_file, merge_file)
        except Exception as e:  # the Rust library raises a bare Exception; the vocab was checked above
            raise TokenizerError(
                f"--merge-file {merge_file}: no BPE model can be built from it with --vocab-file {vocab_file} ({e}); "
                f"pass {MERGES_WHAT}"
            ) from None
        self._tok = Tokenizer(model)
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        self._tok.decoder = decoders.ByteLevel()
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
