"""Preprocessing's encoder (preprocess.py): a chunk of raw JSONL lines -> token arrays per `--json-keys` key, bad
lines recorded with their number and why, a failing tokenizer named at its line."""
from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

import numpy as np

from .indexed_dataset import optimal_dtype
from .preprocess_input import Chunk, PreprocessError
from .sentences import split_sentences
from .tokenizers import TokenizerError, build_tokenizer


@dataclass
class KeyResult:
    tokens: np.ndarray
    lengths: np.ndarray
    seqs_per_doc: np.ndarray
    empty: List[int]  # line numbers of documents that tokenized to nothing


@dataclass
class ChunkResult:
    path: str
    lines: int = 0
    docs: int = 0
    nbytes: int = 0
    blank: int = 0
    bad: List[Tuple[int, str]] = field(default_factory=list)
    keys: Dict[str, KeyResult] = field(default_factory=dict)


class Encoder:
    """Turns a chunk of raw JSONL lines into token arrays, one tokenizer per process."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tokenizer = None

    def initialize(self) -> None:
        """Build the tokenizer; TokenizerError or PreprocessError name the flag at fault."""
        a = self.args
        self.tokenizer = build_tokenizer(a.tokenizer_type, a.vocab_file, a.merge_file, a.tokenizer_model, a.vocab_size)
        self.dtype = optimal_dtype(self.tokenizer.vocab_size)
        self.eod = None
        if a.append_eod:
            try:
                self.eod = self.tokenizer.eod
            except NotImplementedError as e:
                raise PreprocessError(f"--append-eod: {e}; drop --append-eod or choose a tokenizer that has one") from None

    def encode(self, chunk: Chunk) -> ChunkResult:
        """Decode, parse and tokenize the lines of `chunk`; bad lines are recorded, not raised."""
        if self.tokenizer is None:
            self.initialize()
        path, start, lines = chunk
        keys = self.args.json_keys
        res = ChunkResult(path, lines=len(lines))
        docs: List[Tuple[int, Dict[str, str]]] = []
        for lineno, raw in enumerate(lines, start):
            res.nbytes += len(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                res.bad.append((lineno, f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line: "
                                        f"{e.reason}); re-encode the file as UTF-8"))
                continue
            if not line.strip():
                res.blank += 1
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                res.bad.append((lineno, f"not valid JSON ({e.msg} at column {e.colno})"))
                continue
            if not isinstance(obj, dict):
                res.bad.append((lineno, f"a JSON {type(obj).__name__}, not an object"))
                continue
            missing = [k for k in keys if not isinstance(obj.get(k), str)]
            if missing:
                k = missing[0]
                why = "has no key" if k not in obj else f"has a {type(obj[k]).__name__}, not a string, under key"
                res.bad.append((lineno, f"{why} {k!r} (keys present: {', '.join(sorted(obj)) or 'none'})"))
                continue
            docs.append((lineno, {k: obj[k] for k in keys}))
        res.docs = len(docs)
        for key in keys:
            res.keys[key] = self._encode_key(path, key, [(n, d[key]) for n, d in docs])
        return res

    def _encode_key(self, path: str, key: str, docs: List[Tuple[int, str]]) -> KeyResult:
        a = self.args
        if a.split_sentences:
            pieces = [split_sentences(text, a.keep_newlines) for _, text in docs]
        else:
            pieces = [[text] for _, text in docs]
        texts = list(itertools.chain.from_iterable(pieces))
        try:
            flat_ids = self.tokenizer.tokenize_batch(texts) if texts else []
        except Exception:
            self._raise_at_failing_line(path, key, docs, pieces)
            raise  # no single text fails on its own: let the batch error through as it is
        seqs: List[List[int]] = []
        seqs_per_doc: List[int] = []
        empty: List[int] = []
        pos = 0
        for (lineno, _), sents in zip(docs, pieces):
            ids = [s for s in flat_ids[pos : pos + len(sents)] if s]
            pos += len(sents)
            if not ids:
                empty.append(lineno)
                continue
            if self.eod is not None:
                ids[-1] = list(ids[-1]) + [self.eod]
            seqs.extend(ids)
            seqs_per_doc.append(len(ids))
        lengths = np.fromiter((len(s) for s in seqs), dtype=np.int32, count=len(seqs))
        tokens = np.fromiter(itertools.chain.from_iterable(seqs), dtype=self.dtype, count=int(lengths.sum()))
        return KeyResult(tokens, lengths, np.asarray(seqs_per_doc, dtype=np.int64), empty)

    def _raise_at_failing_line(self, path: str, key: str, docs: List[Tuple[int, str]], pieces: List[List[str]]) -> None:
        """A batch failed: tokenize its texts one by one to name the line at fault (raises PreprocessError)."""
        for (lineno, _), sents in zip(docs, pieces):
            for text in sents:
                try:
                    self.tokenizer.tokenize(text)
                except TokenizerError as e:
                    raise PreprocessError(f"{path}:{lineno}: key {key!r}: {e}") from None
                except Exception as e:
                    raise PreprocessError(
                        f"{path}:{lineno}: key {key!r}: the {self.args.tokenizer_type} failed on this text "
                        f"({type(e).__name__}: {e})"
                    ) from None
