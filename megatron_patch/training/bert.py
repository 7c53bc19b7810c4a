"""BERT pretraining on the engine (`pretrain_megatron_bert.py`): masked LM + next-sentence prediction.

`BertTrainer` is the GPT `Trainer` with its data, forward step and losses replaced, as Megatron-LM's
`pretrain_bert.py` defines them: megatron-core's BERTMaskedWordPieceDataset on sentence-split `.bin/.idx`,
a forward step with tokens, token types, padding mask and masked-LM labels, and the loss of
`megatron_patch.models.bert.bert_pretraining_loss` (masked mean of the LM loss + next-sentence cross entropy,
logged as "lm loss" and "sop loss", Megatron-LM's names). The model (megatron-core's BertModel, post-LN as
Hugging Face's) is what `build_model_chunks` builds for --model-family bert. Everything else (TP/PP/DP, ZeRO-1,
mixed precision, checkpoints, logging) is the GPT engine's.
"""
from __future__ import annotations

from functools import partial
from typing import Optional

import torch
from megatron.core import parallel_state as mpu

from megatron_patch.config import Config, ConfigError
from megatron_patch.config.validate import validate_bert_pretraining
from megatron_patch.data.datasets import build_bert_datasets
from megatron_patch.models.bert import bert_pretraining_loss
from megatron_patch.models.build import WeightLoader

from .data import sample_counts
from .loop import Trainer
from .step import no_loss, stage_flags

# One sample of megatron-core's BERT dataset (all int64): token ids, token types (0: sentence A, 1: B),
# MLM labels (-1 where nothing is predicted), is_random (1: B is a random sentence, not A's next),
# loss_mask (1 where a label counts), padding_mask (1 on real tokens).
BATCH_KEYS = ["text", "types", "labels", "is_random", "loss_mask", "padding_mask"]


def bert_forward_step(data_iterator, model):
    """One micro batch through one BERT chunk; returns the output and the loss function.

    Unlike GPT, every pipeline stage needs the batch: each layer's attention masks the padding. Tensor-parallel
    rank 0 of each stage reads it, `broadcast_data` sends it to the others (Megatron-LM's get_batch)."""
    from megatron_patch.parallel.broadcast import broadcast_data

    pre, post = stage_flags(model)
    batch = next(data_iterator) if data_iterator is not None else None
    batch = broadcast_data(BATCH_KEYS, batch, torch.int64)
    # Token types always: the model has their embedding with or without the next-sentence head (as Hugging
    # Face's BERT); without the head the dataset gives one segment, all type 0.
    output = model(batch["text"] if pre else None, batch["padding_mask"],
                   tokentype_ids=batch["types"] if pre else None, lm_labels=batch["labels"] if post else None)
    if not post:
        return output, no_loss
    return output, partial(bert_loss, batch["loss_mask"], batch["is_random"])


def bert_loss(loss_mask: torch.Tensor, is_random: torch.Tensor, output_tensor):
    """The loss function of the last stage: (per-token MLM losses, NSP logits or None) -> (loss, reported losses)."""
    lm_losses, binary_logits = output_tensor
    loss, parts = bert_pretraining_loss(lm_losses, loss_mask, binary_logits, is_random)
    # The schedule divides `loss` in place; without the head it is the "lm loss" itself: report copies.
    return loss, {k: v.clone() for k, v in parts.items()}


class BertTrainer(Trainer):
    """The engine's Trainer for BERT: same loop, BERT data, forward step and losses."""

    reads_where = "tensor-parallel rank 0 of every pipeline stage, which all need the padding mask"

    def __init__(self, cfg: Config, load_weights: Optional[WeightLoader] = None) -> None:
        self.loss_keys = ("lm loss", "sop loss") if cfg.bert_binary_head else ("lm loss",)
        super().__init__(cfg, load_weights)

    def _initialize(self, cfg: Config) -> Config:
        if cfg.model_family != "bert":
            raise ConfigError("BertTrainer trains --model-family bert: build the configuration with "
                              "parse_args(argv, model='bert')")
        validate_bert_pretraining(cfg)  # also for callers that skip the entry point
        return super()._initialize(cfg)

    def _build_datasets(self):
        cfg = self.cfg
        return build_bert_datasets(cfg.data_path, self.tokenizer, cfg.seq_length, sample_counts(cfg), split=cfg.split,
                                   seed=cfg.seed, data_impl=cfg.data_impl, cache_dir=cfg.data_cache_path,
                                   masking_probability=cfg.mask_prob, short_seq_prob=cfg.short_seq_prob,
                                   binary_head=cfg.bert_binary_head)

    def _forward_step_func(self):
        return bert_forward_step

    def _reads_data(self, chunk: torch.nn.Module) -> bool:
        return mpu.get_tensor_model_parallel_rank() == 0


def pretrain_bert(cfg: Config, load_weights: Optional[WeightLoader] = None) -> BertTrainer:
    """Build and run a BERT pretraining job; returns the trainer (its `history` holds per-iteration metrics).
    `load_weights`: weights from outside the engine (--load-hf), as for Trainer."""
    trainer = BertTrainer(cfg, load_weights)
    trainer.train()
    return trainer
