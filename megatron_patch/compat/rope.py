"""Llama 3.x RoPE scaling with the checkpoint's own parameters.

megatron-core 0.19.2 takes the scaling as GPTModel(rope_scaling=True, rope_scaling_factor=F) and RotaryEmbedding
then calls `_apply_scaling(inv_freq, factor=F)`, leaving low_freq_factor, high_freq_factor and
original_max_position_embeddings at their defaults (1, 4, 8192): the values of Meta's official 3.1-3.3
checkpoints. A config.json with other values would be encoded differently than transformers encodes it, so the
built model's frequencies are recomputed with all four values (megatron-core's own `_apply_scaling`, which takes
them as keyword arguments, on the unscaled frequencies).
"""
from __future__ import annotations

import torch

from .registry import register

_ROPE = "megatron/core/models/common/embeddings/rotary_pos_embedding.py:"


@register(upstream=(_ROPE + "RotaryEmbedding.__init__", _ROPE + "RotaryEmbedding._apply_scaling"),
          fixes="RotaryEmbedding applies Llama 3.x RoPE scaling with low/high frequency factors 1 and 4 and an "
                "original context of 8192 hard-coded: recompute its inv_freq with the model's own values",
          fingerprint="1c795a860465f57f")
def llama3_rope_scaling(rotary, *, base: float, factor: float, low_freq_factor: float, high_freq_factor: float,
                        original_max_position_embeddings: int) -> None:
    """Set `rotary.inv_freq` (a megatron-core RotaryEmbedding, before its first forward) to Llama 3.x's scaled
    frequencies for these parameters."""
    inv = rotary.inv_freq
    dim = 2 * inv.numel()  # rotary_percent is 1 for the families that scale
    unscaled = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=inv.device) / dim))
    rotary.inv_freq = rotary._apply_scaling(unscaled, factor=factor, low_freq_factor=low_freq_factor,
                                            high_freq_factor=high_freq_factor,
                                            original_max_position_embeddings=original_max_position_embeddings)
    if hasattr(rotary.forward, "cache_clear"):  # forward is lru_cached on the sequence length
        rotary.forward.cache_clear()
