"""Training data for the engine: tokenizer from the config, GPT datasets, and per-DP-rank micro batches.

torch and megatron-core are imported inside the functions that need them: `check_data` runs in the
launcher's pre-launch check (`pretrain_megatron_gpt.py --validate-only`), which must stay quick.
"""
from __future__ import annotations

from typing import Iterator, Optional, Tuple

from megatron_patch.config import Config
from megatron_patch.data.tokenizers import AbstractTokenizer, build_tokenizer


def tokenizer_from_config(cfg: Config) -> AbstractTokenizer:
    if cfg.tokenizer_type is None:  # --mock-data without a tokenizer: ids 0..vocab_size-1, last is eod
        return build_tokenizer("NullTokenizer", vocab_size=cfg.vocab_size - 1)
    return build_tokenizer(cfg.tokenizer_type, cfg.vocab_file, cfg.merge_file, cfg.tokenizer_model, cfg.vocab_size)


def check_data(cfg: Config) -> str:
    """The checks `build_datasets` makes when it opens the data (prefixes exist, token ids inside the
    tokenizer's vocabulary, every split gets tokens), without building anything; a DataError or
    TokenizerError otherwise. Returns a one-line description for the launcher's summary."""
    if cfg.mock_data:
        return f"mock data (random ids below {cfg.vocab_size or 'the tokenizer vocabulary'})"
    from megatron_patch.data.checks import (DataError, check_bert_documents, check_split_sizes, check_token_ids,
                                            parse_data_path)

    prefixes, _ = parse_data_path(cfg.data_path)
    vocab = tokenizer_from_config(cfg).vocab_size
    largest = check_token_ids(prefixes, vocab, cfg.data_cache_path)
    if cfg.sft:  # conversations: the loss mask beside the tokens, and training conversations in the split
        from megatron_patch.data.sft_dataset import open_sft, split_ranges

        tokens, _ = open_sft(prefixes[0], cfg.data_impl)
        (start, end), *_ = split_ranges(tokens.num_documents, cfg.split)
        if end <= start:
            raise DataError(f"--split {cfg.split} leaves no training conversation of the {tokens.num_documents} "
                            f"in {prefixes[0]}")
        packing = "packed" if cfg.pack_sequences else "one per sample, padded"
        return (f"SFT: {tokens.num_documents} conversations ({packing}), largest token id {largest}, vocabulary "
                f"{vocab}, --split {cfg.split}")
    if cfg.model_family == "bert":  # BERT samples sentences of documents, GPT sequences
        check_bert_documents(prefixes, cfg.split, cfg.bert_binary_head)
    else:
        check_split_sizes(prefixes, cfg.split)
    ids = f"largest token id {largest}" if largest >= 0 else "token ids fit by their dtype"
    return f"{len(prefixes)} file(s), {ids}, vocabulary {vocab}, --split {cfg.split}"


def sample_counts(cfg: Config) -> Tuple[int, int, int]:
    gbs = cfg.global_batch_size
    evals = cfg.train_iters // cfg.eval_interval + 1 if cfg.eval_iters > 0 else 0
    return cfg.train_iters * gbs, max(evals * cfg.eval_iters * gbs, 1), max(cfg.eval_iters * gbs, 1)


def build_datasets(cfg: Config, tokenizer: AbstractTokenizer):
    counts = sample_counts(cfg)
    if cfg.sft:
        from megatron_patch.data.sft_dataset import build_sft_datasets

        pad = getattr(tokenizer, "pad", None)
        return build_sft_datasets(cfg.data_path[0], cfg.seq_length, counts, cfg.split, cfg.seed, cfg.pack_sequences,
                                  pad if isinstance(pad, int) and pad >= 0 else tokenizer.eod, cfg.data_impl)
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


def build_iterator(dataset, cfg: Config, consumed_samples: int = 0, cycle: bool = False,
                   data_parallel: Optional[Tuple[int, int]] = None) -> Optional[Iterator]:
    """Micro batches (dicts of tensors) of this DP rank; `cycle` restarts at the end (evaluation).
    `data_parallel`: (rank, size) of this worker among the readers; default megatron-core's data-parallel group
    (the torch loop passes its workers: it needs no megatron-core parallel state)."""
    import torch

    if dataset is None:
        return None
    if data_parallel is None:
        from megatron.core import parallel_state as mpu

        data_parallel = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    sampler = PretrainingBatchSampler(len(dataset), consumed_samples % len(dataset) if cycle else consumed_samples,
                                      cfg.micro_batch_size, *data_parallel)
    # Its own generator: a DataLoader draws its workers' base seed when an iterator starts, and from the
    # global generator that would shift the dropout stream of a resumed run (which starts its iterator later).
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=cfg.num_workers,
                                         pin_memory=torch.cuda.is_available(), persistent_workers=cfg.num_workers > 0,
                                         generator=torch.Generator().manual_seed(cfg.seed))
    if not cycle:
        return iter(loader)

    def forever():
        while True:
            yield from loader
    return forever()
