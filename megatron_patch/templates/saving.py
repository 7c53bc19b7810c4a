"""Saving a trained Hugging Face model with `save_pretrained`, whatever the switches wrapped it in."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron_patch.accelerations.data_parallel import unwrap  # noqa: F401  (re-exported: the tasks use it)


def full_state_dict(model: torch.nn.Module) -> dict:
    """The whole model's weights on the CPU of rank 0 (collective): FSDP2 shards are gathered."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    inner = unwrap(model)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(inner, options=options)


def save_pretrained(model: torch.nn.Module, path: str, tokenizer=None) -> None:
    """Write model (and tokenizer) to `path` with save_pretrained on rank 0; collective under FSDP2."""
    state = full_state_dict(model)
    if not dist.is_initialized() or dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
        inner = unwrap(model)
        inner.save_pretrained(path, state_dict=state)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
    if dist.is_initialized():
        dist.barrier()
