"""`--data-iterator dynamic-shape|fixed-shape`: batches of variable-length samples.

fixed-shape pads every micro batch to `--seq-length`. dynamic-shape groups samples of similar length
(megatron_patch._C bucketing) under a token budget of micro_batch_size x seq_length and pads each batch
only to its longest sample rounded up to a multiple of 8 (or 64), so far fewer pad tokens are computed.
Batch order is shuffled with the seed, so training does not see lengths in sorted order.

`StepBuckets` does the same for the PreTrainer's Hugging Face loop, one optimizer step at a time (the samples of
a step stay the fixed-shape ones, so a resumed run reads what the whole run would).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterator, List, Sequence

import numpy as np
import torch
import torch.distributed as dist

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


class StepBuckets:
    """`--data-iterator dynamic-shape`: the samples of one optimizer step (this worker's share of a global batch:
    the same samples as fixed-shape) are bucketed by length with the C++ helper (`packing.bucket_by_length`)
    into micro batches of at most --micro-batch-size x --seq-length tokens after padding, each cut to its
    longest sample rounded up to `multiple`: short samples travel many to a micro batch, long ones few. Padding is
    masked out of attention and of the loss, so every sample's loss is the one fixed-shape gives; each micro
    batch's loss is weighted by its share of the step's samples. Every worker runs the same number of micro
    batches (FSDP gathers parameters per forward): a worker with fewer splits its largest.

    The PreTrainer's HF loop (templates/pretrain_hf.py) calls `next_step()` -> number of micro batches (and
    `weights`), then draws that many batches."""

    def __init__(self, base, accum: int, micro_batch_size: int, seq_length: int, multiple: int = 64) -> None:
        self.base, self.accum, self.seq_length, self.multiple = base, accum, seq_length, multiple
        self.budget = micro_batch_size * seq_length
        self.real = self.computed = self.fixed = 0
        self.weights: List[float] = []
        self._queue: List[Dict] = []

    def __iter__(self):
        return self

    def __next__(self) -> Dict:
        if not self._queue:
            raise RuntimeError("dynamic-shape: run_forward_step drew more micro batches than this step has; draw one "
                               "batch per call")
        return self._queue.pop(0)

    def next_step(self) -> int:
        batches = [next(self.base) for _ in range(self.accum)]
        if "attention_mask" not in batches[0]:
            raise ValueError("--data-iterator dynamic-shape cuts the padding of samples with an attention_mask "
                             "(BERT-style sentence pairs); these samples have none (GPT samples are packed to "
                             "--seq-length and carry no padding): drop the flag")
        merged = {k: torch.cat([torch.as_tensor(b[k]) for b in batches]) for k in batches[0]}
        lengths = merged["attention_mask"].sum(dim=1)
        groups = bucket_by_length(lengths.numpy(), self.budget, self.multiple)
        groups = _equalize(groups)
        total, full = len(lengths), merged["attention_mask"].shape[1]
        self._queue, self.weights = [], []
        for idx in groups:
            idx = torch.as_tensor(idx)
            width = padded_length(lengths[idx], "dynamic-shape", self.seq_length, self.multiple)
            # contiguous: a width slice of [samples, full] is a strided view, and models call .view() on their
            # inputs (transformers' BERT: labels.view(-1))
            self._queue.append({k: (v[idx][:, :width].contiguous() if v.dim() >= 2 and v.shape[1] == full else v[idx])
                                for k, v in merged.items()})
            self.weights.append(len(idx) / total)
            self.real += int(lengths[idx].sum())
            self.computed += len(idx) * width
        self.fixed += total * full
        return len(groups)

    def describe(self) -> str:
        pad = PaddingStats(self.real, self.computed).padding_fraction
        fixed = PaddingStats(self.real, self.fixed).padding_fraction
        return (f"dynamic-shape: padding {pad:.1%} of computed tokens (fixed-shape: {fixed:.1%}); "
                f"{self.computed:,} tokens computed instead of {self.fixed:,}")


def _equalize(groups: List) -> List:
    """The same number of micro batches on every worker: split the largest group until all have the maximum."""
    count = torch.tensor([len(groups)], dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_backend() == "nccl":
            count = count.cuda()
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
    groups = list(groups)
    while len(groups) < int(count.item()):
        big = max(range(len(groups)), key=lambda i: len(groups[i]))
        if len(groups[big]) < 2:
            break  # nothing left to split: every worker then still draws its own count (cannot happen with
            # equal micro batch sizes, since the maximum count is at most the step's samples)
        g = groups.pop(big)
        groups[big:big] = [g[: len(g) // 2], g[len(g) // 2:]]
    return groups
