"""Multi-latent attention (DeepSeek-V2/V3) on megatron-core's local spec, without Transformer Engine.

megatron-core 0.19.2 builds MLA's projections through `QKNormConfigResolver`: with `qk_layernorm` (DeepSeek's
latent norms) and no query latent (`q_lora_rank` None: DeepSeek-V2-Lite, whose queries come straight from the
hidden state through q_proj, with no norm), it insists on a *fused* norm + linear for the query projection, which
only Transformer Engine has (the local backend returns a placeholder that fails to build). The model has no query
norm at all; the plain projection the spec names is the right one.
"""
from __future__ import annotations

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
