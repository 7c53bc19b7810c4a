"""Tokenizers selected by `--tokenizer-type`; `build_tokenizer` is the one entry point."""
from __future__ import annotations

from typing import Optional

from .base import NO_TOKEN, AbstractTokenizer, TokenizerError

TOKENIZER_TYPES = (
    "GPT2BPETokenizer",
    "BertWordPieceLowerCase",
    "BertWordPieceCase",
    "SentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
)


def build_tokenizer(
    tokenizer_type: str,
    vocab_file: Optional[str] = None,
    merge_file: Optional[str] = None,
    tokenizer_model: Optional[str] = None,
    vocab_size: Optional[int] = None,
) -> AbstractTokenizer:
    """Make the tokenizer named by `--tokenizer-type` from local files (nothing is downloaded).

    Unusable flags or files raise TokenizerError (a ValueError) naming the flag, the file and the fix.
    """
    if tokenizer_type == "GPT2BPETokenizer":
        from .gpt2 import GPT2BPETokenizer

        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "BertWordPieceLowerCase":
        from .bert import BertWordPieceLowerCase

        return BertWordPieceLowerCase(vocab_file)
    if tokenizer_type == "BertWordPieceCase":
        from .bert import BertWordPieceCase

        return BertWordPieceCase(vocab_file)
    if tokenizer_type == "SentencePieceTokenizer":
        from .sentencepiece import SentencePieceTokenizer

        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "HuggingFaceTokenizer":
        from .huggingface import HuggingFaceTokenizer

        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        from .null import NullTokenizer

        return NullTokenizer(vocab_size)
    raise TokenizerError(f"--tokenizer-type {tokenizer_type!r} is not known; choose one of {', '.join(TOKENIZER_TYPES)}")


__all__ = ["AbstractTokenizer", "NO_TOKEN", "TOKENIZER_TYPES", "TokenizerError", "build_tokenizer"]
