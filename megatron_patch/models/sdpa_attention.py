"""A megatron-core core-attention module that calls torch's `scaled_dot_product_attention`.

megatron-core's local spec computes attention unfused (QK^T, masked softmax, dropout, @V as separate
kernels with the full s x s score matrix in memory); measured on an H200 that makes a 1.3B Llama train
at 0.47x the speed of Hugging Face's SDPA model. SDPA dispatches to flash / memory-efficient / cuDNN
kernels on GPU and to a fused CPU kernel otherwise. Grouped-query attention is handled by SDPA itself.

Packed sequences (megatron-core's THD format: the micro batch as one sequence, `packed_seq_params` giving where
each conversation starts) attend within each conversation: on a GPU in bf16/fp16 through torch's variable-length
flash kernel (`torch.nn.attention.varlen.varlen_attn`), elsewhere (the CPU, fp32) through SDPA with the
block-diagonal causal mask of the conversations. megatron-core's local DotProductAttention refuses packed input.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SDPAttention(DotProductAttention):
    """Drop-in for DotProductAttention: [s, b, heads, d] in, [s, b, heads * d] out."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        if attention_bias is not None:
            raise NotImplementedError("SDPAttention does not support an attention bias; use --attention-backend te")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # -> [b, heads, s, d]
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type == AttnMaskType.causal
        mask = None
        if not causal and attention_mask is not None:
            mask = ~attention_mask  # megatron-core masks are True where attention is *not* allowed
        dropout = self.config.attention_dropout if self.training else 0.0
        def attend():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                                                  scale=self.softmax_scale, enable_gqa=q.size(1) != k.size(1))
        if dropout > 0 and not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():  # same dropout pattern rules as megatron-core
                out = attend()
        else:
            out = attend()
        return out.permute(2, 0, 1, 3).reshape(out.size(2), out.size(0), -1)

    def _packed(self, query, key, value, params):
        """[t, heads, d] in (THD), [t, heads * d] out: causal attention within each conversation."""
        if params.qkv_format != "thd":
            raise NotImplementedError(f"SDPAttention: packed sequences in the {params.qkv_format!r} format; only thd")
        dropout = self.config.attention_dropout if self.training else 0.0
        cu = params.cu_seqlens_q
        if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and dropout == 0:
            out = varlen_causal_attention(query, key, value, cu, params.max_seqlen_q, self.softmax_scale)
        else:
            def attend():
                return packed_sdpa(query, key, value, cu, self.softmax_scale, dropout)
            if dropout > 0 and not self.config.sequence_parallel:
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    out = attend()
            else:
                out = attend()
        return out.reshape(out.size(0), -1)


def conversation_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[t, t] boolean mask, True where token i may attend to token j: j <= i within the same conversation."""
    pos = torch.arange(total, device=cu_seqlens.device)
    segment = torch.searchsorted(cu_seqlens[1:].to(pos.dtype), pos, right=True)
    return (segment[:, None] == segment[None, :]) & (pos[None, :] <= pos[:, None])


def packed_sdpa(query, key, value, cu_seqlens, scale, dropout: float = 0.0) -> torch.Tensor:
    """Packed causal attention through SDPA and the block-diagonal mask (any device and dtype; O(t^2) memory)."""
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))  # [1, heads, t, d]
    mask = conversation_mask(cu_seqlens, q.size(2))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale,
                                         enable_gqa=q.size(1) != k.size(1))
    return out.squeeze(0).transpose(0, 1)  # [t, heads, d]


def varlen_causal_attention(query, key, value, cu_seqlens, max_seqlen: int, scale) -> torch.Tensor:
    """Packed causal attention through torch's variable-length flash kernel (CUDA, bf16/fp16)."""
    from torch.nn.attention.varlen import varlen_attn

    if key.size(1) != query.size(1):  # grouped-query attention: the kernel takes as many key as query heads
        key, value = (x.repeat_interleave(query.size(1) // x.size(1), dim=1) for x in (key, value))
    cu = cu_seqlens.to(torch.int32)
    return varlen_attn(query, key, value, cu, cu, max_seqlen, max_seqlen, scale=scale, window_size=(-1, 0))


class MLASDPAttention(SDPAttention):
    """SDPAttention for multi-latent attention: queries and keys of `k_channels` (the part without RoPE plus the
    rotated part), values of `v_channels`, and MLA's own softmax scale (YaRN's mscale). megatron-core's local
    DotProductAttention cannot serve MLA: it refuses the k_channels/v_channels MLA passes and sizes its output as
    kv_channels x heads; SDPA takes values narrower than the keys as they are."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None) -> None:
        from megatron.core.transformer.module import MegatronModule

        MegatronModule.__init__(self, config=config)  # DotProductAttention's own set-up is what MLA cannot use
        if config.context_parallel_size > 1:
            raise NotImplementedError("MLA with context parallelism needs Transformer Engine's attention")
        self.layer_number, self.attn_mask_type, self.attention_type = max(1, layer_number), attn_mask_type, attention_type
        self.softmax_scale = softmax_scale  # None (Attention's first, discarded build): SDPA's 1/sqrt(channels)
        self.hidden_size_per_attention_head_v = v_channels

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """No parameters (no learnable softmax offset)."""
        if self.config.softmax_type == "learnable":
            raise NotImplementedError("MLA with a learnable softmax offset needs Transformer Engine's attention")
        return {}
