"""`GPTModel()`: the how-to's `from yourmodel import GPTModel` for the Megatron PreTrainer sample."""
from __future__ import annotations

from typing import List, Union

import torch


def GPTModel() -> Union[torch.nn.Module, List[torch.nn.Module]]:  # noqa: N802  (the sample's class-like name)
    """This rank's stage of the GPT that the `rapidformer` flags describe (--num-layers, --hidden-size,
    --num-attention-heads, --seq-length, --max-position-embeddings, the vocabulary of --tokenizer-type/--vocab-file,
    TP/PP from the flags): a megatron-core GPTModel, initialised as `pretrain_megatron_gpt.py` initialises it, or
    a list of them (one per virtual pipeline stage) with --num-layers-per-virtual-pipeline-stage. Call it inside
    PreTrainer.model_optimizer_lr_scheduler_provider(): the PreTrainer hands over how its run builds the model
    (models/run_context.py)."""
    from .run_context import current_build

    chunks = current_build()()
    return chunks[0] if len(chunks) == 1 else chunks
