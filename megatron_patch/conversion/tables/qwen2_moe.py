"""Qwen2-MoE (Hugging Face `Qwen2MoeForCausalLM`: Qwen1.5-MoE, Qwen2-57B-A14B) and Qwen3-MoE (`Qwen3MoeForCausalLM`:
Qwen3-30B-A3B, 235B-A22B) <-> the engine's qwen2_moe / qwen3_moe families: Qwen2's attention (QKV biases) or
Qwen3's (per-head q/k RMSNorm, no biases, head dimension of its own), RMSNorms, and MLPs of two kinds (config.json's `mlp_only_layers` and
`decoder_sparse_step` say which layer has which; the engine's --moe-layer-freq list):

  sparse layers  `mlp.gate.weight` (router) -> `mlp.router.weight`; routed expert e's gate/up/down_proj ->
                 `mlp.experts.local_experts.{e}.linear_fc1` ([gate; up]) / `linear_fc2`; the shared expert's
                 gate/up/down_proj -> `mlp.shared_experts.linear_fc1` / `linear_fc2`, and its sigmoid gate
                 `mlp.shared_expert_gate.weight` [1, H] -> `mlp.shared_experts.gate_weight` (megatron-core's
                 moe_shared_expert_gate computes sigmoid(x @ gate_weight.T) * shared_expert(x), as Qwen2-MoE)
  dense layers   gate/up/down_proj of `intermediate_size` -> `mlp.linear_fc1` / `linear_fc2`, as in Qwen2

Qwen3-MoE has no shared expert. Routing (both): softmax over the experts, top k; `norm_topk_prob` renormalises the k weights (False in the Qwen1.5/2
checkpoints and transformers' default, True in the released Qwen3-MoE ones). Without renormalisation that is megatron-core's --moe-router-pre-softmax; with it, the default
router (top-k logits, softmax over them), as Mixtral.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

from ..family import Family
from ..mapping import SHARED_EXPERT, SHARED_EXPERT_GATE, ConversionError, Rule, Table
from ..transforms import FUSE_GATE_UP
from . import llama

L = "decoder.layers.{i}."
H = "model.layers.{i}."
E = "mlp.experts.local_experts.{e}."
X = "mlp.experts.{e}."

# Qwen2's rules (the llama table's); its MLP rules apply to the dense layers only
QWEN2 = tuple(dataclasses.replace(r, layers="dense") if ".mlp." in r.mcore else r for r in llama.TABLE.rules)

# The router and routed experts of a sparse layer, as transformers saves them (Qwen2/3-MoE, DeepSeek-V2)
ROUTED = (
    Rule(L + "mlp.router.weight", (H + "mlp.gate.weight",), layers="moe"),
    Rule(L + E + "linear_fc1.weight", (H + X + "gate_proj.weight", H + X + "up_proj.weight"), FUSE_GATE_UP,
         layers="moe"),
    Rule(L + E + "linear_fc2.weight", (H + X + "down_proj.weight",), layers="moe"),
)
TABLE = Table("qwen2_moe", QWEN2 + ROUTED + (
    Rule(L + "mlp.shared_experts.linear_fc1.weight",
         (H + "mlp.shared_expert.gate_proj.weight", H + "mlp.shared_expert.up_proj.weight"), FUSE_GATE_UP,
         when=SHARED_EXPERT, layers="moe"),
    Rule(L + "mlp.shared_experts.linear_fc2.weight", (H + "mlp.shared_expert.down_proj.weight",),
         when=SHARED_EXPERT, layers="moe"),
    Rule(L + "mlp.shared_experts.gate_weight", (H + "mlp.shared_expert_gate.weight",), when=SHARED_EXPERT_GATE,
         layers="moe"),
), ignored_hf=llama.TABLE.ignored_hf)


def sparse_layers(c: Dict) -> List[int]:
    """1 for each layer with experts, 0 for a dense one: Qwen2MoeDecoderLayer's rule."""
    step, dense = c.get("decoder_sparse_step", 1), set(c.get("mlp_only_layers") or [])
    return [int(i not in dense and c["num_experts"] > 0 and (i + 1) % step == 0) for i in range(c["num_hidden_layers"])]


def engine_args(c: Dict) -> Dict:
    """Engine Config fields that make the model of a Qwen2-MoE or Qwen3-MoE config.json."""
    qwen3 = c["model_type"] == "qwen3_moe"
    # attention, norms, RoPE, sliding window: the dense family's checks
    args = llama.engine_args(dict(c, model_type="qwen3" if qwen3 else "qwen2"))
    # transformers 5.2x writes Qwen3-MoE's expert count as num_local_experts (num_experts is its alias)
    c = dict(c, num_experts=c.get("num_experts") if c.get("num_experts") is not None else c.get("num_local_experts"))
    pattern = sparse_layers(c)
    if not any(pattern):
        raise ConversionError("config.json: no layer has experts (num_experts, decoder_sparse_step, mlp_only_layers); "
                              f"convert it as a dense {'qwen3' if qwen3 else 'qwen2'} model")
    experts, topk, shared = c["num_experts"], c["num_experts_per_tok"], c.get("shared_expert_intermediate_size")
    if not 1 <= topk <= experts:
        raise ConversionError(f"config.json num_experts_per_tok {topk} must be between 1 and num_experts {experts}")
    if not shared and not qwen3:
        raise ConversionError("config.json shared_expert_intermediate_size must be positive: Qwen2-MoE's shared "
                              "expert and its gate are always built")
    if shared and qwen3:
        raise ConversionError("config.json shared_expert_intermediate_size: Qwen3-MoE has no shared expert")
    args.update(model_family=c["model_type"], num_experts=experts, moe_router_topk=topk,
                moe_ffn_hidden_size=c["moe_intermediate_size"], moe_layer_freq=1 if all(pattern) else pattern,
                moe_router_pre_softmax=not c.get("norm_topk_prob", False),
                moe_aux_loss_coeff=c.get("router_aux_loss_coef", 0.0) if c.get("output_router_logits") else 0.0)
    if not qwen3:
        args.update(add_qkv_bias=bool(c.get("qkv_bias", True)), moe_shared_expert_intermediate_size=shared,
                    moe_shared_expert_gate=True)
    return args


def moe_pattern(g) -> List[int]:
    """1 for each layer with experts, 0 for a dense one, of the engine model read by `g` (--moe-layer-freq)."""
    layers, freq = g("num_layers"), g("moe_layer_freq")
    return [int(i % freq == 0) for i in range(layers)] if isinstance(freq, int) else list(freq)


def hf_config(cfg, vocab: int, eod: Optional[int]) -> Dict:
    """config.json of the engine model `cfg` (a Config or its dict), a Qwen2-MoE or (q/k norms, or named so) a
    Qwen3-MoE; `eod` as in gpt2.hf_config."""
    g = cfg.get if isinstance(cfg, dict) else lambda k: getattr(cfg, k)
    qwen3 = g("model_family") == "qwen3_moe" or g("qk_layernorm")
    if qwen3 and g("moe_shared_expert_intermediate_size"):
        raise ConversionError("this model is not a Qwen3-MoE: Qwen3-MoE has no shared expert "
                              "(--moe-shared-expert-intermediate-size)")
    if qwen3 and (not g("qk_layernorm") or g("add_qkv_bias")):
        raise ConversionError("this model is not a Qwen3-MoE: Qwen3's attention normalises each query and key head "
                              "(--qk-layernorm) and has no QKV bias (--add-qkv-bias)")
    if not qwen3 and not (g("moe_shared_expert_intermediate_size") and g("moe_shared_expert_gate")):
        raise ConversionError("this model is not a Qwen2-MoE: Qwen2-MoE has a shared expert with a sigmoid gate "
                              "(--moe-shared-expert-intermediate-size, --moe-shared-expert-gate)")
    pattern = moe_pattern(g)
    heads, hidden = g("num_attention_heads"), g("hidden_size")
    head_dim = g("kv_channels") or hidden // heads
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=g("ffn_hidden_size") or 4 * hidden,
                  num_hidden_layers=g("num_layers"), num_attention_heads=heads,
                  num_key_value_heads=g("num_query_groups") or heads,
                  max_position_embeddings=g("max_position_embeddings"), rms_norm_eps=g("norm_epsilon"),
                  tie_word_embeddings=not g("untie_embeddings_and_output_weights"),
                  rope_parameters={"rope_type": "default", "rope_theta": float(g("rotary_base"))},
                  attention_dropout=g("attention_dropout"), decoder_sparse_step=1,
                  mlp_only_layers=[i for i, on in enumerate(pattern) if not on],
                  moe_intermediate_size=g("moe_ffn_hidden_size") or g("ffn_hidden_size"),
                  num_experts=g("num_experts"), num_experts_per_tok=g("moe_router_topk"),
                  norm_topk_prob=not g("moe_router_pre_softmax"), router_aux_loss_coef=g("moe_aux_loss_coeff"),
                  hidden_act="silu", bos_token_id=eod, eos_token_id=eod)
    if qwen3:
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(**common, head_dim=head_dim, attention_bias=False,
                              architectures=["Qwen3MoeForCausalLM"]).to_dict()
    from transformers import Qwen2MoeConfig

    c = Qwen2MoeConfig(**common, shared_expert_intermediate_size=g("moe_shared_expert_intermediate_size"),
                       qkv_bias=bool(g("add_qkv_bias")), architectures=["Qwen2MoeForCausalLM"])
    if head_dim * heads != hidden:
        c.head_dim = head_dim  # Qwen2MoeAttention reads it when present
    return c.to_dict()


FAMILY = Family(TABLE, model_types=("qwen2_moe", "qwen3_moe"), engine_families=("qwen2_moe", "qwen3_moe"),
                engine_args=engine_args, hf_config=hf_config)
