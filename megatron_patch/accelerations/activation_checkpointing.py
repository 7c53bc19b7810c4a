"""`--checkpoint-activations`: recompute each layer's activations in the backward pass.

A Hugging Face model that supports it gets its own gradient checkpointing (non-reentrant: works with
DDP, FSDP2 and keyword arguments; transformers 5 checkpoints `forward`, so FSDP2's module hooks stay
outside the recomputed region). Any other model gets each of its layers' `forward` wrapped in
torch.utils.checkpoint (non-reentrant) in place, which keeps the parameter names (state dicts and
checkpoints are unchanged).
"""
from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from .layers import find_layers


def apply_activation_checkpointing(model: torch.nn.Module) -> str:
    if getattr(model, "supports_gradient_checkpointing", False) and hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if getattr(model.config, "use_cache", False):
            model.config.use_cache = False  # a KV cache is meaningless in training and conflicts with recompute
        return ("activation checkpointing: Hugging Face gradient checkpointing (non-reentrant), "
                "each layer recomputed in backward")
    layers = find_layers(model)
    if not layers:
        raise ValueError(f"--checkpoint-activations: {type(model).__name__} does not support Hugging Face gradient "
                         f"checkpointing and has no repeated layers (no _no_split_modules, no nn.ModuleList) to "
                         f"recompute; drop the flag for this model")
    for layer in layers:
        layer.forward = _checkpointed(layer.forward)
    return (f"activation checkpointing: torch.utils.checkpoint (non-reentrant) around {len(layers)} "
            f"{type(layers[0]).__name__} layers")


def _checkpointed(forward):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        if torch.is_grad_enabled():
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)

    return run
