"""torch LayerNorm / RMSNorm usable with `--sequence-parallel`.

megatron-core's own torch-norm wrapper refuses sequence parallelism, because with it each TP rank
normalises a different slice of the sequence and the norm weights' gradients must then be summed across
the TP group. megatron-core's `finalize_model_grads` does that for every parameter marked
`sequence_parallel`, which is all this wrapper adds (as apex's and Transformer Engine's norms do).
"""
from __future__ import annotations

import torch


def torch_norm(config, hidden_size: int, eps: float) -> torch.nn.Module:
    """torch's LayerNorm or RMSNorm, as the model's `normalization` says."""
    if config.normalization == "LayerNorm":
        return torch.nn.LayerNorm(hidden_size, eps=eps)
    if config.normalization == "RMSNorm":
        return torch.nn.RMSNorm(hidden_size, eps=eps)
    raise ValueError(f"normalization {config.normalization!r}: choose LayerNorm or RMSNorm")


class SequenceParallelNorm:
    """Factory with WrappedTorchNorm's signature returning a marked torch norm module."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        norm = torch_norm(config, hidden_size, eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm


class HeadNorm:
    """Factory with WrappedTorchNorm's signature for the per-head query/key norms (`--qk-layernorm`): a torch
    norm over one head's channels. They act after the QKV projection has gathered the sequence, so sequence
    parallelism does not concern them; megatron-core's finalize_model_grads sums their gradients over the TP group
    (each rank normalises its own heads with the shared weight)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        return torch_norm(config, hidden_size, eps)


class LatentNorm:
    """Factory with WrappedTorchNorm's signature for multi-latent attention's query and key/value latent norms.

    Without sequence parallelism every TP rank normalises the same, whole latent and receives the same (already
    all-reduced) gradient, so the weights' gradients are equal on every rank and must not be summed; megatron-core's
    finalize_model_grads sums those named "q_layernorm" of a qk_layernorm model, so they are marked to be averaged
    (the average of equal values is the value). With sequence parallelism megatron-core scatters each latent over the
    sequence before its norm: each rank holds part of the gradient, marked for the sum like the layers' norms."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):
        norm = SequenceParallelNorm(config, hidden_size, eps=eps)
        for p in norm.parameters():
            p.average_gradients_across_tp_domain = not config.sequence_parallel
        return norm
