"""Supervised fine-tuning samples from the conversations of `preprocess_data.py --sft` (tokens + loss mask).

A sample is `--seq-length` tokens holding one conversation (padded) or, packed, several: conversations are packed
into samples by best-fit decreasing (the C++ helper, megatron_patch.data.packing), each epoch over a new shuffle of
the split's conversations, and the samples of an epoch are shuffled too. Within a sample each conversation keeps to
itself: its labels are its own next tokens (its last token predicts nothing), its positions restart at 0, and
`position_ids` tell the model where each conversation starts (the engine attends within them; see
megatron_patch.training.step). Padding after the last conversation has loss mask 0 and positions of its own.

The loss mask of a position is the preprocessed mask of the token it predicts: 1 where that token belongs to an
assistant turn.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .checks import DataError, split_bounds
from .indexed_dataset import IndexedDataset
from .packing import bins_to_groups, pack_documents
from .sft_preprocess import mask_prefix


def split_ranges(count: int, split: str) -> List[Tuple[int, int]]:
    """[start, end) of the train/valid/test conversations under `--split` weights: contiguous, with megatron-core's
    arithmetic (data/checks.py's split_bounds, as check_split_sizes cuts a corpus)."""
    if sum(float(x) for x in split.replace("/", ",").split(",")) <= 0:
        raise DataError(f"--split {split}: the weights must not all be 0")
    return [(int(round(lo * count)), int(round(hi * count))) for lo, hi in split_bounds(split)]


class SFTDataset:
    """`num_samples` samples (dicts of int64 arrays: tokens, labels, loss_mask, position_ids) of the conversations
    `documents`, packed or one per sample, epoch after epoch."""

    def __init__(self, tokens: IndexedDataset, masks: IndexedDataset, documents: np.ndarray, seq_length: int,
                 num_samples: int, seed: int, pack: bool, pad_id: int) -> None:
        self.tokens, self.masks, self.seq_length, self.pad_id = tokens, masks, seq_length, pad_id
        self.lengths = np.minimum(tokens.sequence_lengths[tokens.document_indices[documents]], seq_length)
        self.documents = np.asarray(documents, dtype=np.int64)
        self.samples: List[np.ndarray] = []
        epoch = 0
        while len(self.samples) < num_samples:
            self.samples.extend(self._epoch(np.random.RandomState(seed + epoch), pack))
            epoch += 1
        self.samples = self.samples[:num_samples]

    def _epoch(self, rng: np.random.RandomState, pack: bool) -> List[np.ndarray]:
        order = rng.permutation(len(self.documents))
        if not pack:
            return [self.documents[[i]] for i in order]
        groups = bins_to_groups(pack_documents(self.lengths[order], self.seq_length))
        samples = [self.documents[order[g]] for g in groups]
        return [samples[i] for i in rng.permutation(len(samples))]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        s = self.seq_length
        tokens = np.full(s, self.pad_id, dtype=np.int64)
        labels = np.full(s, self.pad_id, dtype=np.int64)
        loss_mask = np.zeros(s, dtype=np.int64)
        position_ids = np.zeros(s, dtype=np.int64)
        at = 0
        for doc in self.samples[idx]:
            seq = self.tokens.document_indices[doc]  # one sequence per conversation
            ids = self.tokens.get(seq)[:s].astype(np.int64)
            mask = self.masks.get(seq)[:s].astype(np.int64)
            n = len(ids)
            tokens[at:at + n] = ids
            labels[at:at + n - 1] = ids[1:]
            loss_mask[at:at + n - 1] = mask[1:]
            position_ids[at:at + n] = np.arange(n)
            at += n
        position_ids[at:] = np.arange(s - at)  # the padding: a segment of its own
        return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}

    def conversations(self, idx: int) -> np.ndarray:
        """The conversation (document) ids of sample `idx`."""
        return self.samples[idx]


def open_sft(prefix: str, data_impl: str = "mmap") -> Tuple[IndexedDataset, IndexedDataset]:
    """The token and loss-mask datasets of an SFT prefix, checked to describe the same conversations."""
    masks_prefix = mask_prefix(prefix)
    tokens = IndexedDataset(prefix, impl=data_impl)
    try:
        masks = IndexedDataset(masks_prefix, impl=data_impl)
    except FileNotFoundError:
        raise DataError(f"--sft --data-path {prefix}: no loss mask {masks_prefix}.bin/.idx next to it; make both with "
                        f"tools/preprocess_data.py --sft") from None
    if tokens.num_documents != masks.num_documents or not np.array_equal(tokens.sequence_lengths, masks.sequence_lengths):
        raise DataError(f"{prefix} and {masks_prefix} describe different conversations (document counts "
                        f"{tokens.num_documents} and {masks.num_documents}): write both in one preprocess_data.py --sft run")
    if tokens.num_documents != len(tokens.sequence_lengths):
        raise DataError(f"{prefix}: documents of several sequences; an SFT dataset holds one sequence per conversation")
    return tokens, masks


def build_sft_datasets(prefix: str, seq_length: int, num_samples: Sequence[int], split: str, seed: int, pack: bool,
                       pad_id: int, data_impl: str = "mmap") -> Tuple[Optional[SFTDataset], ...]:
    """(train, valid, test) SFT datasets of `num_samples` samples each (None where a split has no conversation)."""
    tokens, masks = open_sft(prefix, data_impl)
    out = []
    for i, ((start, end), n) in enumerate(zip(split_ranges(tokens.num_documents, split), num_samples)):
        if end <= start:
            if i == 0:
                raise DataError(f"--split {split} leaves no training conversation of the {tokens.num_documents} in {prefix}")
            out.append(None)
            continue
        out.append(SFTDataset(tokens, masks, np.arange(start, end), seq_length, n, seed + 1000 * i, pack, pad_id))
    return tuple(out)
