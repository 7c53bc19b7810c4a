"""Multi-latent attention (DeepSeek-V2/V3) on megatron-core's local spec, without Transformer Engine.

megatron-core 0.19.2 builds MLA's projections through `QKNormConfigResolver`: with `qk_layernorm` (DeepSeek's
latent norms) and no query latent (`q_lora_rank` None: DeepSeek-V2-Lite, whose queries come straight from the
hidden state through q_proj, with no norm), it insists on a *fused* norm + linear for the query projection, which
only Transformer Engine has (the local backend returns a placeholder that fails to build). The model has no query
norm at all; the plain projection the spec names is the right one.
"""
from __future__ import annotations

import torch

from .registry import original, register, replace

_RESOLVER = "megatron/core/transformer/mla_qk_norm_config.py:QKNormConfigResolver."


@register(upstream=(_RESOLVER + "_resolve_mla_qk_layernorm", _RESOLVER + "_reject_common_spec_conflicts"),
          fixes="with qk_layernorm and no q_lora_rank, megatron-core's MLA resolver requires Transformer Engine's fused "
                "norm + linear for linear_q_proj although there is no query norm: keep the spec's plain projection",
          fingerprint="029018793c67d7cc")
def mla_query_projection_without_norm() -> None:
    """Let MLASelfAttention build the spec's own `linear_q_proj` (and explicit latent norms) when q_lora_rank is None."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mla_qk_norm_config import QKNormConfigResolver as resolver

    upstream = original(resolver, "_resolve_mla_qk_layernorm")

    def resolve(self):
        spec = self.submodules
        kv_norm = spec.kv_layernorm or IdentityOp
        if (self.has_q_lora or spec.linear_q_proj is None or self._is_fused_norm_linear(spec.linear_q_proj)
                or self._is_trivial(kv_norm)):
            return upstream(self)
        return self._result(linear_q_proj=spec.linear_q_proj, linear_q_up_proj=IdentityOp,
                            linear_kv_up_proj=self._non_fused_or_default(spec.linear_kv_up_proj, "linear_kv_up_proj"),
                            q_layernorm=IdentityOp, kv_layernorm=kv_norm)

    replace(resolver, "_resolve_mla_qk_layernorm", resolve)


class _SumRotaryGrads(torch.autograd.Function):
    """Identity forward; backward sums the last `rope_dim` channels' gradient over the TP group `group`."""

    @staticmethod
    def forward(ctx, t, rope_dim: int, group):
        ctx.rope_dim, ctx.group = rope_dim, group
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        part = grad[..., -ctx.rope_dim:].contiguous()
        torch.distributed.all_reduce(part, group=ctx.group)
        grad[..., -ctx.rope_dim:] = part
        return grad, None, None


@register(upstream=("megatron/core/transformer/multi_latent_attention.py:MLASelfAttention._qkv_down_projection",
                    "megatron/core/transformer/multi_latent_attention.py:MLASelfAttention.get_query_key_value_tensors"),
          fixes="with a column-parallel linear_kv_down_proj (the local spec) at TP > 1, megatron-core gathers the kv "
                "latent and the shared RoPE key, but the RoPE key's gradient comes only from each rank's own heads and "
                "the gather's backward keeps one slice of it: the other ranks' heads are lost. Gather here instead, "
                "summing that gradient over the TP group (with sequence parallelism: scatter the sequence back, so "
                "megatron-core's own gather of the RoPE key over the sequence sums it in its backward)",
          fingerprint="04cd87d56b0fe417")
def mla_rotary_key_gradient_over_tp() -> None:
    """Make MLASelfAttention's key/value down projection whole on every TP rank, with correct gradients."""
    from megatron.core.tensor_parallel.mappings import (gather_from_tensor_model_parallel_region,
                                                        scatter_to_sequence_parallel_region)
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    upstream = original(MLASelfAttention, "_qkv_down_projection")

    def down_projection(self, hidden_states):
        q_compressed, kv_combined = upstream(self, hidden_states)
        full = self.config.kv_lora_rank + self.config.qk_pos_emb_head_dim
        if kv_combined.size(-1) != full:  # column-parallel: this rank's slice of the channels
            kv_combined = gather_from_tensor_model_parallel_region(kv_combined)
            if self.config.sequence_parallel:
                kv_combined = scatter_to_sequence_parallel_region(kv_combined)  # megatron-core then gathers the key
            else:
                kv_combined = _SumRotaryGrads.apply(kv_combined, self.config.qk_pos_emb_head_dim, self.tp_group)
        return q_compressed, kv_combined

    replace(MLASelfAttention, "_qkv_down_projection", down_projection)
