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


_ROPE_UTILS = "megatron/core/models/common/embeddings/rope_utils.py:"


def _thd_rope_one_pass(t, cu_seqlens, freqs, rotary_interleaved=False, mla_rotary_interleaved=False, mscale=1.0,
                       cp_group=None, multi_latent_attention=None):
    """RoPE of a THD tensor [t, heads, d] with positions restarting at every cu_seqlens boundary, in one pass: each
    token's position within its sequence, computed on the device, picks its row of `freqs` [max_s, 1, 1, d]."""
    from megatron.core.models.common.embeddings import rope_utils

    from .registry import original

    if (cp_group is not None and cp_group.size() > 1) or multi_latent_attention is not None or \
            freqs.size(0) == t.size(0):  # context parallelism / whole-batch freqs: upstream's own loop
        return original(rope_utils, "_apply_rotary_pos_emb_thd")(
            t, cu_seqlens, freqs, rotary_interleaved=rotary_interleaved, mla_rotary_interleaved=mla_rotary_interleaved,
            mscale=mscale, cp_group=cp_group, multi_latent_attention=multi_latent_attention)
    pos = torch.arange(t.size(0), device=t.device)
    cu = cu_seqlens.to(device=t.device, dtype=torch.long)
    within = pos - cu[torch.searchsorted(cu[1:], pos, right=True)]
    return rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), freqs[within], rotary_interleaved=rotary_interleaved,
                                                 mla_rotary_interleaved=mla_rotary_interleaved, mscale=mscale).squeeze(1)


@register(upstream=_ROPE_UTILS + "_apply_rotary_pos_emb_thd",
          fixes="packed sequences (THD) get RoPE one sequence at a time: a Python loop over every conversation of the "
                "micro batch, with a host read of the lengths, in every attention layer for queries and keys; this "
                "computes each token's position on the device and applies RoPE to the whole micro batch at once",
          fingerprint="99798acffbb2e50c")
def packed_rope_in_one_pass() -> None:
    """Replace megatron-core's per-sequence THD RoPE by `_thd_rope_one_pass` (same result, without context
    parallelism; with it, upstream's loop still runs)."""
    from megatron.core.models.common.embeddings import rope_utils

    from .registry import replace

    replace(rope_utils, "_apply_rotary_pos_emb_thd", _thd_rope_one_pass)
