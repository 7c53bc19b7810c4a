"""`--data-iterator dynamic-shape|fixed-shape`: batches of variable-length samples.

fixed-shape pads every micro batch to `--seq-length`. dynamic-shape groups samples of similar length
(megatron_patch._C bucketing) under a token budget of micro_batch_size x seq_length and pads each batch
only to its longest sample rounded up to a multiple of 8 (or 64), so far fewer pad tokens are computed.
Batch order is shuffled with the seed, so training does not see lengths in sorted order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterator, List, Sequence

import numpy as np
import torch

from .packing import bucket_by_length

ITERATORS = ("fixed-shape", "dynamic-shape")


@dataclass
class PaddingStats:
    real_tokens: int
    padded_tokens: int

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0


def make_batches(
    lengths: Sequence[int],
    iterator: str,
    micro_batch_size: int,
    seq_length: int,
    multiple: int = 8,
    seed: int = 1234,
) -> List[np.ndarray]:
    """Sample indices of each micro batch for the chosen `--data-iterator`."""
    if iterator not in ITERATORS:
        raise ValueError(f"--data-iterator {iterator!r}: choose one of {', '.join(ITERATORS)}")
    rng = np.random.default_rng(seed)
    lengths = np.minimum(np.asarray(lengths, dtype=np.int64), seq_length)
    if iterator == "fixed-shape":
        order = rng.permutation(len(lengths))
        return [order[i : i + micro_batch_size] for i in range(0, len(order), micro_batch_size)]
    batches = bucket_by_length(lengths, micro_batch_size * seq_length, multiple)
    return [batches[i] for i in rng.permutation(len(batches))]


def padded_length(lengths: np.ndarray, iterator: str, seq_length: int, multiple: int) -> int:
    if iterator == "fixed-shape":
        return seq_length
    return min(seq_length, int(-(-int(lengths.max()) // multiple) * multiple))


def padding_stats(lengths, batches: List[np.ndarray], iterator: str, seq_length: int, multiple: int = 8) -> PaddingStats:
    """Real vs computed (padded) tokens over all batches."""
    lengths = np.minimum(np.asarray(lengths, dtype=np.int64), seq_length)
    real = padded = 0
    for b in batches:
        real += int(lengths[b].sum())
        padded += len(b) * padded_length(lengths[b], iterator, seq_length, multiple)
    return PaddingStats(real, padded)


class VariableLengthBatches:
    """Iterate micro batches of {tokens, labels, loss_mask, attention_mask} tensors.

    `samples` is any indexable of 1-D token arrays (e.g. documents of an IndexedDataset); each sample
    is truncated to seq_length + 1 so that inputs and shifted labels are both seq_length long.
    """

    def __init__(self, samples, iterator: str, micro_batch_size: int, seq_length: int, pad_id: int,
                 multiple: int = 8, seed: int = 1234) -> None:
        self.samples = samples
        self.iterator = iterator
        self.seq_length = seq_length
        self.multiple = multiple
        self.pad_id = pad_id
        self.lengths = np.asarray([min(len(samples[i]), seq_length + 1) - 1 for i in range(len(samples))])
        self.batches = make_batches(self.lengths, iterator, micro_batch_size, seq_length, multiple, seed)

    def __len__(self) -> int:
        return len(self.batches)

    def stats(self) -> PaddingStats:
        return padding_stats(self.lengths, self.batches, self.iterator, self.seq_length, self.multiple)

    def __iter__(self) -> Iterator[Dict[str, torch.Tensor]]:
        for b in self.batches:
            width = padded_length(self.lengths[b], self.iterator, self.seq_length, self.multiple)
            tokens = torch.full((len(b), width), self.pad_id, dtype=torch.long)
            labels = torch.full((len(b), width), self.pad_id, dtype=torch.long)
            loss_mask = torch.zeros((len(b), width), dtype=torch.float)
            for row, i in enumerate(b):
                seq = torch.as_tensor(np.asarray(self.samples[i][: self.seq_length + 1], dtype=np.int64))
                n = len(seq) - 1
                tokens[row, :n] = seq[:-1]
                labels[row, :n] = seq[1:]
                loss_mask[row, :n] = 1.0
            yield {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "attention_mask": loss_mask.bool()}


class DocumentSamples:
    """The documents of an IndexedDataset as samples (all their sequences concatenated)."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return self.dataset.num_documents

    def __getitem__(self, doc: int) -> np.ndarray:
        parts = self.dataset.document(doc)
        return np.concatenate(parts) if len(parts) > 1 else parts[0]
