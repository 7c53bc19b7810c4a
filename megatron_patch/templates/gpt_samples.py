"""What the how-to's Megatron GPT PreTrainer sample calls: `build_train_valid_test_datasets` (GPT samples with key
`text`) and `get_ltor_masks_and_position_ids` (left-to-right masks), with Megatron-LM's signatures."""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import numpy as np
import torch


class TextSamples(torch.utils.data.Dataset):
    """A megatron-core GPTDataset seen as Megatron-LM's GPT samples: {"text": seq_length + 1 token ids}, the
    inputs and, shifted by one, the labels."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: int):
        sample = self.dataset[idx]
        tokens, labels = np.asarray(sample["tokens"]), np.asarray(sample["labels"])
        return {"text": np.concatenate([tokens, labels[-1:]]).astype(np.int64)}


def build_train_valid_test_datasets(data_prefix: Union[str, Sequence[str]], data_impl: str, splits_string: str,
                                    train_valid_test_num_samples: Sequence[int], seq_length: int, seed: int,
                                    skip_warmup: bool = True, tokenizer=None) -> Tuple[Optional[TextSamples], ...]:
    """(train, valid, test) GPT datasets over the mmap corpus `data_prefix` (a prefix made by
    tools/preprocess_data.py, or Megatron's blend list `[w1, p1, w2, p2]`), split by `splits_string`
    ("980,20" has no test split: None), with the given numbers of samples. Samples are {"text": int64 array of
    seq_length + 1 tokens}. The tokenizer is the flags' (`get_tokenizer()`) unless given. `skip_warmup=False`
    (--mmap-warmup) reads the corpus once first, which only warms the page cache."""
    from megatron_patch.data.datasets import build_gpt_datasets, parse_data_path

    from .globals import get_args
    from .pretraining_data import get_tokenizer

    prefixes = data_prefix.split() if isinstance(data_prefix, str) else list(data_prefix)
    if not skip_warmup:
        _warm_up(parse_data_path(prefixes)[0])
    args = get_args()
    splits = build_gpt_datasets(prefixes, tokenizer or get_tokenizer(), seq_length,
                                tuple(int(n) for n in train_valid_test_num_samples), split=splits_string, seed=seed,
                                data_impl=data_impl, cache_dir=getattr(args, "data_cache_path", None),
                                eod_mask_loss=bool(getattr(args, "eod_mask_loss", False)))
    return tuple(TextSamples(ds) if ds is not None else None for ds in splits)


def _warm_up(prefixes: Sequence[str]) -> None:
    for prefix in prefixes:
        with open(prefix + ".bin", "rb") as f:
            while f.read(1 << 24):
                pass


def get_ltor_masks_and_position_ids(data: torch.Tensor, eod_token: int, reset_position_ids: bool,
                                    reset_attention_mask: bool, eod_mask_loss: bool
                                    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Masks and positions for left-to-right language modelling of `data` [batch, seq], as Megatron-LM defines
    them: `attention_mask` [1 or batch, 1, seq, seq] bool, True where attention is NOT allowed (the future;
    with `reset_attention_mask` also earlier documents); `loss_mask` [batch, seq] float, 0 on end-of-document
    tokens when `eod_mask_loss`; `position_ids` [batch, seq], restarting after each end-of-document token when
    `reset_position_ids`."""
    b, s = data.shape
    rows = b if reset_attention_mask else 1
    allowed = torch.tril(torch.ones((rows, s, s), dtype=torch.bool, device=data.device))
    loss_mask = torch.ones(data.shape, dtype=torch.float, device=data.device)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0
    position_ids = torch.arange(s, dtype=torch.long, device=data.device).unsqueeze(0).expand(b, s).clone()
    if reset_position_ids or reset_attention_mask:
        for i in range(b):
            ends = (data[i] == eod_token).nonzero(as_tuple=True)[0].tolist()
            start = 0
            for end in ends:  # a new document starts after each end-of-document token
                if end + 1 >= s:
                    break
                if reset_attention_mask:
                    allowed[i, end + 1:, :end + 1] = False
                if reset_position_ids:
                    position_ids[i, end + 1:] -= end + 1 - start
                start = end + 1
    return (~allowed).unsqueeze(1), loss_mask, position_ids
