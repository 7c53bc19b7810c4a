"""A megatron-core core-attention module that calls torch's `scaled_dot_product_attention`.

megatron-core's local spec computes attention unfused (QK^T, masked softmax, dropout, @V as separate
kernels with the full s x s score matrix in memory); measured on an H200 that makes a 1.3B Llama train
at 0.47x the speed of Hugging Face's SDPA model. SDPA dispatches to flash / memory-efficient / cuDNN
kernels on GPU and to a fused CPU kernel otherwise. Grouped-query attention is handled by SDPA itself.
"""
from __future__ import annotations

import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SDPAttention(DotProductAttention):
    """Drop-in for DotProductAttention: [s, b, heads, d] in, [s, b, heads * d] out."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPAttention supports neither packed sequences nor attention bias; use --attention-backend te")
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
