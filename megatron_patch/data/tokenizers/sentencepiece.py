"""SentencePiece model file (.model), run by Google's `sentencepiece` library (the reference)."""
from __future__ import annotations

from typing import Dict, List, Sequence

from .base import NO_TOKEN, AbstractTokenizer, TokenizerError, require_file

MODEL_WHAT = "a SentencePiece .model file (written by spm_train or tools/train_tokenizer.py)"


class SentencePieceTokenizer(AbstractTokenizer):
    name = "SentencePieceTokenizer"

    def __init__(self, tokenizer_model: str) -> None:
        self.source = {"tokenizer_model": tokenizer_model}
        import sentencepiece as spm

        require_file(tokenizer_model, "--tokenizer-model", self.name, MODEL_WHAT)
        try:
            self._sp = spm.SentencePieceProcessor(model_file=tokenizer_model)
        except (RuntimeError, OSError) as e:  # sentencepiece's message names neither the flag nor the fix
            raise TokenizerError(
                f"--tokenizer-model {tokenizer_model}: not a SentencePiece model ({e}); pass {MODEL_WHAT}. "
                f"A Hugging Face tokenizer directory needs --tokenizer-type HuggingFaceTokenizer."
            ) from None
        self._vocab = {self._sp.id_to_piece(i): i for i in range(self._sp.get_piece_size())}

    def tokenize(self, text: str) -> List[int]:
        return self._sp.encode(text, out_type=int)

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return self._sp.encode(list(texts), out_type=int)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode(list(ids))

    @property
    def vocab(self) -> Dict[str, int]:
        return self._vocab

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eod(self) -> int:
        if self._sp.eos_id() < 0:
            raise NotImplementedError("this SentencePiece model has no </s> (eos) piece to end documents with")
        return self._sp.eos_id()

    @property
    def pad(self) -> int:
        return self._sp.pad_id() if self._sp.pad_id() >= 0 else NO_TOKEN

    @property
    def bos(self) -> int:
        return self._sp.bos_id()
