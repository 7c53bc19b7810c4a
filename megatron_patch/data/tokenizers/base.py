"""The one tokenizer interface every `--tokenizer-type` implements.

The attribute names are the ones megatron-core's datasets read (`vocab_size`, `eod`, `pad`, `cls`,
`sep`, `mask`, `inv_vocab`), so an instance can be passed straight to megatron-core's dataset configs.
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Dict, List, Optional, Sequence

# megatron-core's datasets treat -1 as "this tokenizer has no pad token".
NO_TOKEN = -1


class TokenizerError(ValueError):
    """A tokenizer's flags or files are unusable, or text it cannot tokenize.

    The message names the flag and file (or the offending token) and the fix, so command-line tools
    print it as is instead of a traceback.
    """


def require_file(path: Optional[str], flag: str, owner: str, what: str) -> str:
    """`path` when it names a regular file; otherwise a TokenizerError naming `flag`, the path and `what` it should be."""
    if not path:
        raise TokenizerError(f"{owner} needs {flag} PATH to {what}")
    if os.path.isdir(path):
        raise TokenizerError(f"{flag} {path}: is a directory; pass the path of {what}")
    if not os.path.isfile(path):
        raise TokenizerError(f"{flag} {path}: no such file; pass the path of {what}")
    return path


class AbstractTokenizer(ABC):
    """Text <-> token ids. Subclasses set `name` and implement the abstract members."""

    name: str = "abstract"
    source: Dict[str, str] = {}  # the files it was built from; part of the dataset cache key

    @property
    def unique_identifiers(self) -> Dict[str, object]:
        """What megatron-core hashes into its dataset cache names."""
        return {"class": self.name, "vocab_size": self.vocab_size, **self.source}

    @abstractmethod
    def tokenize(self, text: str) -> List[int]:
        """Ids of `text`, without any special tokens added."""

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """Ids of many texts; subclasses override this with a batched (Rust) path."""
        return [self.tokenize(t) for t in texts]

    @abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of `ids`."""

    @property
    @abstractmethod
    def vocab(self) -> Dict[str, int]:
        """Token string -> id."""

    @property
    def inv_vocab(self) -> Dict[int, str]:
        if not hasattr(self, "_inv_vocab"):
            self._inv_vocab = {v: k for k, v in self.vocab.items()}
        return self._inv_vocab

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def eod(self) -> int:
        """End-of-document id appended by `--append-eod` and used between documents in samples."""
        raise NotImplementedError(f"{self.name} has no end-of-document token")

    @property
    def pad(self) -> int:
        return NO_TOKEN

    def _special(self, what: str) -> int:
        raise NotImplementedError(f"{self.name} has no {what} token; BERT data needs a WordPiece vocabulary")

    @property
    def cls(self) -> int:
        return self._special("[CLS]")

    @property
    def sep(self) -> int:
        return self._special("[SEP]")

    @property
    def mask(self) -> int:
        return self._special("[MASK]")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"
