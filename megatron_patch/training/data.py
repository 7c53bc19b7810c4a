"""Training data for the engine: tokenizer from the config, GPT datasets, and per-DP-rank micro batches."""
from __future__ import annotations

from typing import Iterator, Optional, Tuple

import torch
from megatron.core import parallel_state as mpu

from megatron_patch.config import Config
from megatron_patch.data.tokenizers import AbstractTokenizer, build_tokenizer


def tokenizer_from_config(cfg: Config) -> AbstractTokenizer:
    if cfg.tokenizer_type is None:  # --mock-data without a tokenizer: ids 0..vocab_size-1, last is eod
        return build_tokenizer("NullTokenizer", vocab_size=cfg.vocab_size - 1)
    return build_tokenizer(cfg.tokenizer_type, cfg.vocab_file, cfg.merge_file, cfg.tokenizer_model, cfg.vocab_size)


def sample_counts(cfg: Config) -> Tuple[int, int, int]:
    gbs = cfg.global_batch_size
    evals = cfg.train_iters // cfg.eval_interval + 1 if cfg.eval_iters > 0 else 0
    return cfg.train_iters * gbs, max(evals * cfg.eval_iters * gbs, 1), max(cfg.eval_iters * gbs, 1)


def build_datasets(cfg: Config, tokenizer: AbstractTokenizer):
    counts = sample_counts(cfg)
    if cfg.mock_data:
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset

        config = GPTDatasetConfig(random_seed=cfg.seed, sequence_length=cfg.seq_length, split="1,1,1",
                                  tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False,
                                  eod_mask_loss=cfg.eod_mask_loss, create_attention_mask=False)
        return BlendedMegatronDatasetBuilder(MockGPTDataset, list(counts), lambda: True, config).build()
    from megatron_patch.data.datasets import build_gpt_datasets

    return build_gpt_datasets(cfg.data_path, tokenizer, cfg.seq_length, counts, split=cfg.split, seed=cfg.seed,
                              data_impl=cfg.data_impl, cache_dir=cfg.data_cache_path, eod_mask_loss=cfg.eod_mask_loss)


class PretrainingBatchSampler:
    """Megatron's pretraining order: global batch k is samples [k*gbs, (k+1)*gbs); within it, micro step j
    holds samples [j*mbs*dp, (j+1)*mbs*dp) and this DP rank takes its mbs-slice. Starts at `consumed`."""

    def __init__(self, total: int, consumed: int, micro_batch_size: int, dp_rank: int, dp_size: int) -> None:
        self.total, self.consumed = total, consumed
        self.mbs, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size

    def __len__(self) -> int:
        return (self.total - self.consumed) // (self.mbs * self.dp_size)

    def __iter__(self):
        step = self.mbs * self.dp_size
        for start in range(self.consumed, self.total - step + 1, step):
            first = start + self.dp_rank * self.mbs
            yield list(range(first, first + self.mbs))


def build_iterator(dataset, cfg: Config, consumed_samples: int = 0, cycle: bool = False) -> Optional[Iterator]:
    """Micro batches (dicts of tensors) of this DP rank; `cycle` restarts at the end (evaluation)."""
    if dataset is None:
        return None
    sampler = PretrainingBatchSampler(len(dataset), consumed_samples % len(dataset) if cycle else consumed_samples,
                                      cfg.micro_batch_size, mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size())
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=cfg.num_workers,
                                         pin_memory=torch.cuda.is_available(), persistent_workers=cfg.num_workers > 0)
    if not cycle:
        return iter(loader)

    def forever():
        while True:
            yield from loader
    return forever()
