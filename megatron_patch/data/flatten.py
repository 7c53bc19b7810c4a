"""`--padding-free`: a micro batch's samples concatenated into one row of tokens, without padding between them.

`FlattenCollator(collate, multiple, max_segment)` wraps the collate function that pads a batch (a task's
`DataCollatorWithPadding`, a Finetuner script's own) and turns each padded batch into one packed row. The
padded batch must be padded on the right (its attention_mask a run of ones, then zeros, in every row); it may
hold input_ids, attention_mask, token_type_ids and labels. The packed batch (`PACKED_KEYS`):

    sample_starts   [n]      the row of each sample's first token ([CLS]), in batch order; first, because the
                             loop counts a batch's samples by its first entry
    input_ids       [1, T]   the samples' tokens one after another, then a filler segment of pad tokens up to T
    token_type_ids  [1, T]   per token (when the padded batch has them; the filler's are 0)
    position_ids    [1, T]   0, 1, ... restarting at each sample (the filler's are all 0)
    cu_seq_lens     [n + 2]  int32: 0, the end of each sample, T; the filler is the last segment (it may be empty)
    max_seq_len     int      an upper bound of every segment's length, the same for every batch of the run (a
                             static argument for compiled code and CUDA graphs): max(max_segment, multiple)
    labels          [n]      per-sample labels, as given; or per-token labels [1, T] packed like the tokens, with
                             -100 (no loss) on the filler

T is the number of tokens rounded up to a multiple of `multiple`: the token budgets, one compiled shape (and one
CUDA graph) each. The samples, their order and their tokens are those of the padded batch, so a model run on the
packed row (accelerations/padding_free.py) computes the padded batch's per-sample outputs and loss.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List

import torch

PACKED_KEYS = ("sample_starts", "input_ids", "token_type_ids", "position_ids", "cu_seq_lens", "max_seq_len", "labels")
IGNORE_INDEX = -100  # cross entropy's ignore_index: the filler tokens carry no loss
_PADDED_KEYS = ("input_ids", "attention_mask", "token_type_ids", "labels")


def is_packed(batch: Any) -> bool:
    return hasattr(batch, "keys") and "cu_seq_lens" in batch


class FlattenCollator:
    """collate(samples) -> a padded batch -> one packed row (module docstring). `multiple`: the row is padded to a
    multiple of this many tokens; `max_segment`: the longest sample allowed (the model's position embeddings)."""

    def __init__(self, collate: Callable[[List[Any]], Dict], multiple: int, max_segment: int) -> None:
        if multiple < 1:
            raise ValueError(f"--padding-free: --pad-to-multiple-of {multiple}: give a positive number of tokens")
        self.collate, self.multiple, self.max_segment = collate, int(multiple), int(max_segment)
        self.max_seq_len = max(self.max_segment, self.multiple)

    def __call__(self, samples: List[Any]) -> Dict[str, Any]:
        return flatten(self.collate(samples), self.multiple, self.max_segment, self.max_seq_len)


def flatten(batch: Dict[str, Any], multiple: int, max_segment: int, max_seq_len: int) -> Dict[str, Any]:
    """One padded batch (right padding) -> one packed row (module docstring)."""
    other = sorted(set(batch.keys()) - set(_PADDED_KEYS))
    if other or "input_ids" not in batch or "attention_mask" not in batch:
        raise ValueError(f"--padding-free packs batches of input_ids, attention_mask, token_type_ids and labels; "
                         f"this collate function returned {sorted(batch.keys())}"
                         + (f" ({', '.join(other)} cannot be packed)" if other else "")
                         + ": drop --padding-free, or return only those keys")
    ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    if ids.dim() != 2 or mask.shape != ids.shape:
        raise ValueError(f"--padding-free: input_ids {tuple(ids.shape)} and attention_mask {tuple(mask.shape)} must "
                         "be padded batches of the same shape [samples, length]")
    if mask.shape[1] > 1 and bool((mask[:, 1:] & ~mask[:, :-1]).any()):
        raise ValueError("--padding-free: the batch is not padded on the right (a token follows padding in its "
                         "attention_mask); pad on the right (tokenizer.padding_side = 'right'), or drop "
                         "--padding-free")
    lengths = mask.sum(1)
    n = int(lengths.numel())
    if n and int(lengths.min()) < 1:
        raise ValueError("--padding-free: a sample of the batch has no tokens (an all-zero attention_mask row)")
    if n and int(lengths.max()) > max_segment:
        raise ValueError(f"--padding-free: a sample of {int(lengths.max())} tokens is longer than the model's "
                         f"{max_segment} positions")
    keep = mask.reshape(-1)  # right padding: row-major order is sample 0's tokens, then sample 1's, ...
    total = int(lengths.sum())
    width = -(-total // multiple) * multiple
    ends = torch.cumsum(lengths, 0)
    starts = ends - lengths
    cu = torch.zeros(n + 2, dtype=torch.int32)
    cu[1:n + 1] = ends.to(torch.int32)
    cu[n + 1] = width
    within = torch.arange(total) - torch.repeat_interleave(starts, lengths)

    def row(values: torch.Tensor, fill: int) -> torch.Tensor:
        out = torch.full((1, width), fill, dtype=values.dtype)
        out[0, :total] = values.reshape(-1)[keep]
        return out

    out: Dict[str, Any] = {"sample_starts": starts.to(torch.long), "input_ids": row(ids, 0)}
    if "token_type_ids" in batch:
        out["token_type_ids"] = row(batch["token_type_ids"], 0)
    position_ids = torch.zeros((1, width), dtype=torch.long)
    position_ids[0, :total] = within
    out.update(position_ids=position_ids, cu_seq_lens=cu, max_seq_len=max_seq_len)
    if "labels" in batch:
        labels = batch["labels"]
        if labels.dim() == 2 and labels.shape == ids.shape:
            out["labels"] = row(labels, IGNORE_INDEX)
        elif labels.dim() == 1 and labels.shape[0] == n:
            out["labels"] = labels
        else:
            raise ValueError(f"--padding-free: labels of shape {tuple(labels.shape)} are neither one per sample "
                             f"[{n}] nor one per token {tuple(ids.shape)}")
    return out
