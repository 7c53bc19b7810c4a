"""`GPTModel()`: the how-to's `from yourmodel import GPTModel` for the Megatron PreTrainer sample."""
from __future__ import annotations

from typing import List, Union

import torch


def GPTModel() -> Union[torch.nn.Module, List[torch.nn.Module]]:  # noqa: N802  (the sample's class-like name)
    """This rank's stage of the GPT that the `rapidformer` flags describe (--num-layers, --hidden-size,
    --num-attention-heads, --seq-length, --max-position-embeddings, the vocabulary of --tokenizer-type/--vocab-file,
    TP/PP from the flags): a megatron-core GPTModel, initialised as `pretrain_megatron_gpt.py` initialises it, or
    a list of them (one per virtual pipeline stage) with --num-layers-per-virtual-pipeline-stage. Call it inside
    PreTrainer.model_optimizer_lr_scheduler_provider()."""
    from megatron_patch.templates.pretrain_megatron import current_config
    from megatron_patch.training.data import tokenizer_from_config
    from megatron_patch.training.loop import build_model_chunks, model_vocab_size

    cfg = current_config()
    chunks = build_model_chunks(cfg, model_vocab_size(cfg, tokenizer_from_config(cfg)))
    return chunks[0] if len(chunks) == 1 else chunks
