"""BERT pretraining on the engine (`pretrain_megatron_bert.py`): masked LM + next-sentence prediction.

`BertTrainer` is the GPT `Trainer` with four parts replaced, as Megatron-LM's `pretrain_bert.py` defines
them: the data (megatron-core's BERTMaskedWordPieceDataset on sentence-split `.bin/.idx`), the model
(megatron-core's BertModel, `megatron_patch.models.bert`), the forward step (tokens, token types, padding
mask, masked-LM labels) and the loss (masked mean of the LM loss + next-sentence cross entropy). Everything
else (TP/PP/DP, ZeRO-1, mixed precision, checkpoints, logging) is the GPT engine's.
"""
from __future__ import annotations

from functools import partial
from typing import List

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as mpu

from megatron_patch.config import Config
from megatron_patch.data.datasets import build_bert_datasets
from megatron_patch.models.bert import build_bert_model

from .data import sample_counts
from .loop import Trainer, build_model_chunks, no_loss, stage_flags

# One sample of megatron-core's BERT dataset (all int64): token ids, token types (0: sentence A, 1: B),
# MLM labels (-1 where nothing is predicted), is_random (1: B is a random sentence, not A's next),
# loss_mask (1 where a label counts), padding_mask (1 on real tokens).
BATCH_KEYS = ["text", "types", "labels", "is_random", "loss_mask", "padding_mask"]


def bert_forward_step(data_iterator, model, binary_head: bool = True):
    """One micro batch through one BERT chunk; returns the output and the loss function.

    Unlike GPT, every pipeline stage needs the batch: each layer's attention masks the padding. Tensor-parallel
    rank 0 of each stage reads it, `broadcast_data` sends it to the others."""
    from megatron_patch.parallel.broadcast import broadcast_data

    pre, post = stage_flags(model)
    batch = next(data_iterator) if data_iterator is not None else None
    batch = broadcast_data(BATCH_KEYS, batch, torch.int64)
    # Without the binary head the model has no token-type embedding (Megatron-LM passes none either).
    types = batch["types"] if pre and binary_head else None
    output = model(batch["text"] if pre else None, batch["padding_mask"], tokentype_ids=types,
                   lm_labels=batch["labels"] if post else None)
    if not post:
        return output, no_loss
    return output, partial(bert_loss, batch["loss_mask"].float(), batch["is_random"])


def bert_loss(loss_mask: torch.Tensor, is_random: torch.Tensor, output_tensor):
    """Megatron-LM's BERT loss: the per-token LM losses averaged over the masked positions, plus the
    next-sentence cross entropy when the model has the binary head. Both are reported on their own."""
    lm_losses, nsp_logits = output_tensor
    lm = (lm_losses.float().reshape(-1) * loss_mask.reshape(-1)).sum() / loss_mask.sum().clamp(min=1)
    if nsp_logits is None:
        return lm, {"lm loss": lm.detach().clone()}  # the schedule divides the loss in place: report copies
    nsp = F.cross_entropy(nsp_logits.reshape(-1, 2).float(), is_random.reshape(-1))
    return lm + nsp, {"lm loss": lm.detach().clone(), "nsp loss": nsp.detach().clone()}


class BertTrainer(Trainer):
    """The engine's Trainer for BERT: same loop, BERT data, model, forward step and losses."""

    reads_where = "tensor-parallel rank 0 of every pipeline stage, which all need the padding mask"

    def __init__(self, cfg: Config) -> None:
        self.loss_keys = ("lm loss", "nsp loss") if cfg.bert_binary_head else ("lm loss",)
        super().__init__(cfg)

    def _build_datasets(self):
        cfg = self.cfg
        return build_bert_datasets(cfg.data_path, self.tokenizer, cfg.seq_length, sample_counts(cfg), split=cfg.split,
                                   seed=cfg.seed, data_impl=cfg.data_impl, cache_dir=cfg.data_cache_path,
                                   masking_probability=cfg.mask_prob, short_seq_prob=cfg.short_seq_prob,
                                   binary_head=cfg.bert_binary_head)

    def _build_chunks(self, vocab: int) -> List[torch.nn.Module]:
        return build_model_chunks(self.cfg, vocab, build=partial(build_bert_model, add_binary_head=self.cfg.bert_binary_head))

    def _forward_step_func(self):
        return partial(bert_forward_step, binary_head=self.cfg.bert_binary_head)

    def _reads_data(self, chunk: torch.nn.Module) -> bool:
        return mpu.get_tensor_model_parallel_rank() == 0


def pretrain_bert(cfg: Config) -> BertTrainer:
    """Build and run a BERT pretraining job; returns the trainer (its `history` holds per-iteration metrics)."""
    trainer = BertTrainer(cfg)
    trainer.train()
    return trainer
