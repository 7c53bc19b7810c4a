"""BERT WordPiece (vocab.txt), lower-cased or cased, run by the Rust `tokenizers` library.

Same normalisation as Google's BERT / Hugging Face's BertTokenizerFast: clean text, split CJK
characters, lower-case and strip accents for the uncased variant, `##` continuation pieces.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

from tokenizers import BertWordPieceTokenizer, models

from .base import AbstractTokenizer, TokenizerError, require_file

VOCAB_WHAT = "a BERT WordPiece vocab.txt (one token per line, with [CLS], [SEP], [MASK] and [PAD])"


class _BertWordPiece(AbstractTokenizer):
    """Shared code of the two BERT variants; use the subclasses."""

    lower_case = True

    def __init__(self, vocab_file: str) -> None:
        self.source = {"vocab_file": vocab_file}
        require_file(vocab_file, "--vocab-file", self.name, VOCAB_WHAT)
        # Read and check the vocabulary first: the library's own errors name neither file nor flag.
        try:
            vocab = models.WordPiece.read_file(vocab_file)
        except Exception as e:  # the Rust library raises a bare Exception (e.g. a binary file)
            raise TokenizerError(f"--vocab-file {vocab_file}: cannot be read as a vocabulary ({e}); pass {VOCAB_WHAT}") from None
        missing = [t for t in ("[CLS]", "[SEP]", "[MASK]", "[PAD]") if t not in vocab]
        if missing:
            with open(vocab_file, "rb") as f:
                looks_json = f.read(1) == b"{"
            hint = " It looks like a JSON vocabulary (GPT-2's vocab.json needs --tokenizer-type GPT2BPETokenizer)." if looks_json else ""
            raise TokenizerError(
                f"--vocab-file {vocab_file} lacks {', '.join(missing)}, so it is not a BERT WordPiece vocabulary; "
                f"pass {VOCAB_WHAT}.{hint}"
            )
        self._tok = BertWordPieceTokenizer(
            vocab, lowercase=self.lower_case, strip_accents=self.lower_case, clean_text=True,
            handle_chinese_chars=True,
        )
        self._vocab = self._tok.get_vocab()
        self._batch = getattr(self._tok._tokenizer, "encode_batch_fast", self._tok._tokenizer.encode_batch)

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
    def cls(self) -> int:
        return self._vocab["[CLS]"]

    @property
    def sep(self) -> int:
        return self._vocab["[SEP]"]

    @property
    def mask(self) -> int:
        return self._vocab["[MASK]"]

    @property
    def pad(self) -> int:
        return self._vocab["[PAD]"]

    @property
    def eod(self) -> int:
        # Megatron-LM's BERT tokenizers end documents with [SEP].
        return self.sep


class BertWordPieceLowerCase(_BertWordPiece):
    name = "BertWordPieceLowerCase"
    lower_case = True


class BertWordPieceCase(_BertWordPiece):
    name = "BertWordPieceCase"
    lower_case = False
