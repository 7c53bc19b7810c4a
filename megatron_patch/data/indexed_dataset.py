"""Megatron's indexed dataset format (.bin + .idx), written and read byte-compatibly with Megatron-LM
and megatron-core.

Layout, all little-endian:
  .idx  magic b"MMIDIDX\\x00\\x00" | version u64 = 1 | dtype code u8 | sequence count u64 |
        document count u64 (documents + 1) | int32 sequence lengths | int64 byte offsets into .bin |
        int64 document indices (sequence index where each document starts; first 0, last = count)
  .bin  the tokens, back to back, in the dtype named by the code

Readers (`--data-impl`): `mmap` memory-maps the .bin (default), `cached` reads it whole into RAM,
`lazy` reads each item from the file on demand (positional reads, safe in forked workers), `infer` picks from the header (mmap for MMIDIDX).
Every reader checks sizes on open, so a truncated or corrupt file is refused with its name and the fault.
"""
from __future__ import annotations

import os
import struct
from typing import List, Optional, Sequence, Union

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count

DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
DATA_IMPLS = ("mmap", "cached", "lazy", "infer")


def optimal_dtype(vocab_size: Optional[int]) -> type:
    """uint16 when ids fit (< 65,500 entries, Megatron's rule), else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


class CorruptIndexError(ValueError):
    """A .bin/.idx pair that cannot be read as Megatron's format; the message names file and fault."""


class IndexedDatasetWriter:
    """Append documents (each one or more sequences of token ids) and finalize into prefix.bin/.idx.

    Files are written aside (`.tmp`) and renamed on `finalize()`, so a crash never leaves a pair that
    looks complete. Used as a context manager, a writer not finalized by the end of the block is aborted.
    """

    def __init__(self, prefix: str, dtype: type = np.int32) -> None:
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF:
            raise ValueError(f"dtype {self.dtype} is not one of Megatron's index dtypes")
        os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
        self._bin = open(bin_path(prefix) + ".tmp", "wb")
        self._lengths: List[np.ndarray] = []
        self._doc_starts: List[int] = [0]
        self._num_sequences = 0
        self._finalized = False

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, *exc) -> None:
        if not self._finalized:
            self.abort()

    def add_document(self, sequences: Sequence[Sequence[int]]) -> None:
        """One document made of `sequences` (sentences, or a single sequence)."""
        lengths = np.fromiter((len(s) for s in sequences), dtype=np.int32, count=len(sequences))
        flat = np.concatenate([np.asarray(s, dtype=self.dtype) for s in sequences]) if len(sequences) else np.zeros(0, self.dtype)
        self.add_documents(flat, lengths, np.array([len(sequences)], dtype=np.int64))

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray, sequences_per_document: np.ndarray) -> None:
        """Many documents at once: all their tokens, each sequence's length, each document's sequence count."""
        if int(lengths.sum(dtype=np.int64)) != len(tokens) or int(sequences_per_document.sum()) != len(lengths):
            raise ValueError("add_documents: token, length and document counts disagree")
        self._bin.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self._lengths.append(np.asarray(lengths, dtype=np.int32))
        ends = self._num_sequences + np.cumsum(sequences_per_document, dtype=np.int64)
        self._doc_starts.extend(ends.tolist())
        self._num_sequences += len(lengths)

    def add_index(self, other_prefix: str) -> None:
        """Append another finished pair (same dtype) after what was written so far."""
        other = IndexedDataset(other_prefix, impl="mmap")
        if other.dtype != self.dtype:
            raise ValueError(f"{idx_path(other_prefix)} holds {other.dtype}, this file {self.dtype}")
        self._lengths.append(other.sequence_lengths.astype(np.int32))
        self._doc_starts.extend((other.document_indices[1:] + self._num_sequences).tolist())
        self._num_sequences += len(other.sequence_lengths)
        with open(bin_path(other_prefix), "rb") as f:
            while chunk := f.read(1 << 24):
                self._bin.write(chunk)

    def abort(self) -> None:
        """Drop what was written; nothing is published."""
        self._bin.close()
        for p in (bin_path(self.prefix) + ".tmp", idx_path(self.prefix) + ".tmp"):
            if os.path.exists(p):
                os.remove(p)

    def finalize(self) -> None:
        """Write the .idx and publish the pair under its final names."""
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        docs = np.asarray(self._doc_starts, dtype=np.int64)
        with open(idx_path(self.prefix) + ".tmp", "wb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, CODE_OF[self.dtype], len(lengths), len(docs)))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(docs.astype("<i8").tobytes())
        os.replace(bin_path(self.prefix) + ".tmp", bin_path(self.prefix))
        os.replace(idx_path(self.prefix) + ".tmp", idx_path(self.prefix))
        self._finalized = True


def read_header(prefix: str):
    """(dtype, sequence count, document count, header size) of prefix.idx, or CorruptIndexError."""
    path = idx_path(prefix)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such index file (is --data-path a prefix without .bin/.idx?)")
    with open(path, "rb") as f:
        head = f.read(HEADER.size)
    if len(head) < HEADER.size:
        raise CorruptIndexError(f"{path}: {len(head)} bytes, shorter than the {HEADER.size}-byte header")
    magic, version, code, n_seq, n_doc = HEADER.unpack(head)
    if magic != MAGIC:
        raise CorruptIndexError(f"{path}: wrong magic {magic!r}, expected {MAGIC!r}; not a Megatron mmap index")
    if version != VERSION:
        raise CorruptIndexError(f"{path}: index version {version}, only version {VERSION} is known")
    if code not in DTYPE_CODES:
        raise CorruptIndexError(f"{path}: unknown dtype code {code}")
    return np.dtype(DTYPE_CODES[code]), n_seq, n_doc, HEADER.size


class IndexedDataset:
    """Read prefix.bin/.idx. `ds[i]` is sequence i as a numpy array; `ds.get(i, offset, length)` a slice."""

    def __init__(self, prefix: str, impl: str = "mmap") -> None:
        if impl not in DATA_IMPLS:
            raise ValueError(f"--data-impl {impl!r}: choose one of {', '.join(DATA_IMPLS)}")
        self.prefix = prefix
        self.dtype, n_seq, n_doc, offset = read_header(prefix)
        self.impl = "mmap" if impl == "infer" else impl  # the only on-disk format is MMIDIDX
        ipath, bpath = idx_path(prefix), bin_path(prefix)
        expected = offset + n_seq * 4 + n_seq * 8 + n_doc * 8
        actual = os.path.getsize(ipath)
        if actual != expected:
            raise CorruptIndexError(
                f"{ipath}: {actual} bytes, but its header ({n_seq} sequences, {n_doc} document entries) "
                f"needs {expected}; the file is truncated or corrupt"
            )
        self._idx = np.memmap(ipath, mode="r", order="C")
        self.sequence_lengths = np.frombuffer(self._idx, dtype="<i4", count=n_seq, offset=offset)
        self.sequence_pointers = np.frombuffer(self._idx, dtype="<i8", count=n_seq, offset=offset + n_seq * 4)
        self.document_indices = np.frombuffer(self._idx, dtype="<i8", count=n_doc, offset=offset + n_seq * 12)
        self._check(ipath, bpath, n_seq, n_doc)
        if self.impl == "mmap":
            self._bin = np.memmap(bpath, mode="r", order="C") if os.path.getsize(bpath) else np.zeros(0, np.uint8)
        elif self.impl == "cached":
            self._bin = np.fromfile(bpath, dtype=np.uint8)
        else:
            self._bin = None
            self._file = open(bpath, "rb")

    def _check(self, ipath: str, bpath: str, n_seq: int, n_doc: int) -> None:
        if not os.path.isfile(bpath):
            raise FileNotFoundError(f"{bpath}: data file missing next to {ipath}")
        if n_doc < 1 or self.document_indices[0] != 0 or self.document_indices[-1] != n_seq:
            raise CorruptIndexError(f"{ipath}: document indices must run from 0 to the sequence count {n_seq}")
        if n_doc > 1 and np.any(np.diff(self.document_indices) < 0):
            raise CorruptIndexError(f"{ipath}: document indices are not in increasing order")
        if n_seq and np.any(self.sequence_lengths < 0):
            raise CorruptIndexError(f"{ipath}: negative sequence length")
        needed = int(self.sequence_lengths.sum(dtype=np.int64)) * self.dtype.itemsize
        actual = os.path.getsize(bpath)
        if actual != needed:
            what = "truncated" if actual < needed else "longer than its index says"
            raise CorruptIndexError(
                f"{bpath}: {actual} bytes, but {ipath} describes {needed} bytes of {self.dtype} tokens; the .bin is {what}"
            )
        if n_seq and self.sequence_pointers[-1] + int(self.sequence_lengths[-1]) * self.dtype.itemsize != needed:
            raise CorruptIndexError(f"{ipath}: byte offsets do not match the sequence lengths")

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens of sequence `idx` from `offset`, `length` of them (default: to the end)."""
        if not -len(self) <= idx < len(self):
            raise IndexError(f"sequence {idx} out of range for {len(self)} sequences in {self.prefix}")
        size = int(self.sequence_lengths[idx])
        length = size - offset if length is None else length
        start = int(self.sequence_pointers[idx]) + offset * self.dtype.itemsize
        if self._bin is not None:
            return np.frombuffer(self._bin, dtype=self.dtype, count=length, offset=start)
        # A positional read: forked DataLoader workers share this descriptor and its file offset, so
        # seek-then-read in two of them at once could read another item's bytes.
        data = os.pread(self._file.fileno(), length * self.dtype.itemsize, start)
        if len(data) != length * self.dtype.itemsize:
            raise CorruptIndexError(f"{bin_path(self.prefix)}: ends before byte {start + length * self.dtype.itemsize}; "
                                    f"was it truncated after it was opened?")
        return np.frombuffer(data, dtype=self.dtype)

    def __getitem__(self, idx: Union[int, slice]) -> Union[np.ndarray, List[np.ndarray]]:
        if isinstance(idx, slice):
            return [self.get(i) for i in range(*idx.indices(len(self)))]
        return self.get(int(idx))

    def document(self, doc: int) -> List[np.ndarray]:
        """The sequences (sentences) of document `doc`."""
        a, b = self.document_indices[doc], self.document_indices[doc + 1]
        return [self.get(i) for i in range(a, b)]

    def __del__(self) -> None:
        f = getattr(self, "_file", None)
        if f is not None:
            f.close()
