"""DeepSeek-V2 (Hugging Face `DeepseekV2ForCausalLM`: DeepSeek-V2, V2-Lite, V2.5) <-> the engine's deepseek_v2 family:
multi-latent attention (megatron-core's MLASelfAttention), RMSNorms, the first `first_k_dense_replace` layers with a
dense SwiGLU MLP and the others with routed experts plus always-on shared experts.

  attention  q_proj (or q_a_proj, q_a_layernorm, q_b_proj with q_lora_rank) -> linear_q_proj (linear_q_down_proj,
             q_layernorm, linear_q_up_proj); kv_a_proj_with_mqa [kv latent; k RoPE part] -> linear_kv_down_proj,
             kv_a_layernorm -> kv_layernorm, kv_b_proj [per head: k without RoPE; v] -> linear_kv_up_proj, o_proj ->
             linear_proj. Each tensor keeps its layout: megatron-core splits the rows exactly as transformers does
             (per head [nope; rope] for queries, [latent; rope] for the down projection, per head [k; v] for the up
             projection), and its MLA RoPE takes the rotated channels as interleaved pairs (`mla_rotary_interleaved`,
             de-interleaving them before rotating), which is how DeepSeek's checkpoints store them.
  MLP        dense layers as Llama; sparse layers: mlp.gate -> mlp.router, the experts as Qwen2-MoE's, the shared
             experts (one MLP of n_shared_experts x moe_intermediate_size) -> mlp.shared_experts, without a gate.

Routing: softmax over all experts, the top k taken as they are (`topk_method` greedy; DeepSeek-V2's router never
renormalises, whatever `norm_topk_prob` says) times `routed_scaling_factor`: megatron-core's
--moe-router-pre-softmax with --moe-router-topk-scaling-factor. `group_limited_greedy` (DeepSeek-V2's device-limited
routing by the best expert of each group) is refused: megatron-core's group-limited routing scores a group by the
sum of its best experts (DeepSeek-V3's rule). RoPE: default, or YaRN with its mscale/mscale_all_dim softmax scaling.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

from ..family import Family
from ..mapping import NO_Q_LORA, Q_LORA, SHARED_EXPERT, UNTIED, ConversionError, Rule, Table
from ..transforms import FUSE_GATE_UP, PAD_VOCAB
from . import llama, qwen2_moe

L = "decoder.layers.{i}."
H = "model.layers.{i}."
A = L + "self_attention."
HA = H + "self_attn."

TABLE = Table("deepseek_v2", (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), PAD_VOCAB),
    Rule(L + "input_layernorm.weight", (H + "input_layernorm.weight",)),
    Rule(A + "linear_q_proj.weight", (HA + "q_proj.weight",), when=NO_Q_LORA),
    Rule(A + "linear_q_down_proj.weight", (HA + "q_a_proj.weight",), when=Q_LORA),
    Rule(A + "q_layernorm.weight", (HA + "q_a_layernorm.weight",), when=Q_LORA),
    Rule(A + "linear_q_up_proj.weight", (HA + "q_b_proj.weight",), when=Q_LORA),
    Rule(A + "linear_kv_down_proj.weight", (HA + "kv_a_proj_with_mqa.weight",)),
    Rule(A + "kv_layernorm.weight", (HA + "kv_a_layernorm.weight",)),
    Rule(A + "linear_kv_up_proj.weight", (HA + "kv_b_proj.weight",)),
    Rule(A + "linear_proj.weight", (HA + "o_proj.weight",)),
    Rule(L + "pre_mlp_layernorm.weight", (H + "post_attention_layernorm.weight",)),
    Rule(L + "mlp.linear_fc1.weight", (H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight"), FUSE_GATE_UP,
         layers="dense"),
    Rule(L + "mlp.linear_fc2.weight", (H + "mlp.down_proj.weight",), layers="dense"),
    *qwen2_moe.ROUTED,
    Rule(L + "mlp.shared_experts.linear_fc1.weight",
         (H + "mlp.shared_experts.gate_proj.weight", H + "mlp.shared_experts.up_proj.weight"), FUSE_GATE_UP,
         when=SHARED_EXPERT, layers="moe"),
    Rule(L + "mlp.shared_experts.linear_fc2.weight", (H + "mlp.shared_experts.down_proj.weight",),
         when=SHARED_EXPERT, layers="moe"),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Rule("output_layer.weight", ("lm_head.weight",), PAD_VOCAB, when=UNTIED),
), ignored_hf=llama.TABLE.ignored_hf)
# DeepSeek's latent norms are built with RMSNorm's default epsilon, not rms_norm_eps (modeling_deepseek_v2.py)
LATENT_NORM_EPS = 1e-6
YARN = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def moe_layers(c: Dict) -> List[int]:
    """1 for each layer with experts: DeepseekV2DecoderLayer's rule (the first first_k_dense_replace are dense)."""
    return [int(i >= (c.get("first_k_dense_replace") or 0)) for i in range(c["num_hidden_layers"])]


def _rope_args(c: Dict) -> Dict:
    p = llama.rope_parameters(c)
    kind = p["rope_type"]
    if kind not in ("default", "yarn"):
        raise ConversionError(f"config.json rope type {kind!r}: DeepSeek's multi-latent attention runs RoPE of type "
                              f"'default' or 'yarn' in the engine")
    args = dict(rotary_base=float(p["rope_theta"]), rope_type="rope" if kind == "default" else "yarn")
    if kind == "yarn":
        if p.get("attention_factor") is not None:
            raise ConversionError(f"config.json rope attention_factor {p['attention_factor']}: the engine derives YaRN's "
                                  f"attention factor from mscale and mscale_all_dim, as DeepSeek does")
        if p.get("truncate") is False:
            raise ConversionError("config.json rope truncate false: the engine's YaRN rounds the correction range "
                                  "(truncate true, DeepSeek's)")
        defaults = dict(beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.0,
                        original_max_position_embeddings=c.get("max_position_embeddings"))
        v = {k: p.get(k) if p.get(k) is not None else defaults.get(k) for k in YARN}
        if v["factor"] is None:
            raise ConversionError("config.json rope type 'yarn' without a factor")
        args.update(rotary_scaling_factor=float(v["factor"]), beta_fast=float(v["beta_fast"]),
                    beta_slow=float(v["beta_slow"]), mscale=float(v["mscale"]), mscale_all_dim=float(v["mscale_all_dim"]),
                    original_max_position_embeddings=int(v["original_max_position_embeddings"]))
    return args


def engine_args(c: Dict) -> Dict:
    """Engine Config fields that make the model of a DeepSeek-V2 config.json."""
    if c.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"config.json hidden_act {c['hidden_act']!r}: the engine's SwiGLU uses silu")
    if c.get("attention_bias") or c.get("mlp_bias"):
        raise ConversionError("config.json attention_bias/mlp_bias: DeepSeek-V2's projections have no biases in the "
                              "engine")
    if (c.get("pretraining_tp") or 1) != 1:
        raise ConversionError(f"config.json pretraining_tp {c['pretraining_tp']}: set it to 1")
    eps = c.get("rms_norm_eps", 1e-6)
    if not math.isclose(eps, LATENT_NORM_EPS):
        raise ConversionError(f"config.json rms_norm_eps {eps}: DeepSeek-V2's latent norms use 1e-6 whatever it says, "
                              f"the engine one epsilon for every norm; only 1e-6 converts exactly")
    if (c.get("scoring_func") or "softmax") != "softmax":
        raise ConversionError(f"config.json scoring_func {c['scoring_func']!r}: DeepSeek-V2's router scores with "
                              f"softmax in transformers and in the engine")
    method = c.get("topk_method") or "greedy"
    if method != "greedy":
        raise ConversionError(f"config.json topk_method {method!r}: the engine routes greedily (softmax, top k); "
                              f"DeepSeek-V2's group-limited routing differs from megatron-core's (V3's) group rule")
    experts = c.get("n_routed_experts") if c.get("n_routed_experts") is not None else c.get("num_experts")
    topk, shared = c.get("num_experts_per_tok"), c.get("n_shared_experts") or 0
    pattern = moe_layers(c)
    if not experts or not topk or not any(pattern):
        raise ConversionError("config.json: no layer has experts (n_routed_experts, num_experts_per_tok, "
                              "first_k_dense_replace); the engine converts DeepSeek-V2 as a mixture of experts")
    if not 1 <= topk <= experts:
        raise ConversionError(f"config.json num_experts_per_tok {topk} must be between 1 and n_routed_experts {experts}")
    if (c.get("moe_layer_freq") or 1) != 1:
        raise ConversionError(f"config.json moe_layer_freq {c['moe_layer_freq']}: every layer after the dense ones has "
                              f"experts in DeepSeek-V2's transformers model")
    heads, moe_ffn = c["num_attention_heads"], c["moe_intermediate_size"]
    return dict(model_family="deepseek_v2", num_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"],
                num_attention_heads=heads, num_query_groups=None, ffn_hidden_size=c["intermediate_size"],
                max_position_embeddings=c["max_position_embeddings"], position_embedding_type="rope",
                normalization="RMSNorm", norm_epsilon=eps, swiglu=True, openai_gelu=False,
                untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", False), disable_bias_linear=True,
                add_qkv_bias=False, qk_layernorm=True, multi_latent_attention=True, q_lora_rank=c.get("q_lora_rank"),
                kv_lora_rank=c["kv_lora_rank"], qk_head_dim=c["qk_nope_head_dim"],
                qk_pos_emb_head_dim=c["qk_rope_head_dim"], v_head_dim=c["v_head_dim"], hidden_dropout=0.0,
                attention_dropout=c.get("attention_dropout", 0.0), model_vocab_size=c["vocab_size"],
                num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=moe_ffn,
                moe_layer_freq=1 if all(pattern) else pattern, moe_router_pre_softmax=True,
                moe_router_topk_scaling_factor=float(c.get("routed_scaling_factor") or 1.0),
                moe_shared_expert_intermediate_size=shared * moe_ffn if shared else None, moe_shared_expert_gate=False,
                # training only: DeepSeek's balance loss (per sequence with seq_aux)
                moe_aux_loss_coeff=float(c.get("aux_loss_alpha") or 0.0),
                moe_router_load_balancing_type="seq_aux_loss" if c.get("seq_aux") else "aux_loss", **_rope_args(c))


def hf_config(cfg, vocab: int, eod: Optional[int]) -> Dict:
    """config.json of the engine model `cfg` (a Config or its dict); `eod` as in gpt2.hf_config."""
    from transformers import DeepseekV2Config

    g = cfg.get if isinstance(cfg, dict) else lambda k: getattr(cfg, k)
    if not g("multi_latent_attention") or not g("num_experts"):
        raise ConversionError("this model is not a DeepSeek-V2: it has multi-latent attention "
                              "(--multi-latent-attention) and experts (--num-experts)")
    if g("moe_shared_expert_gate") or not g("moe_router_pre_softmax"):
        raise ConversionError("this model is not a DeepSeek-V2: its shared experts have no gate and its router takes "
                              "the softmax over all experts (--moe-router-pre-softmax)")
    pattern = qwen2_moe.moe_pattern(g)
    layers, freq = g("num_layers"), g("moe_layer_freq")
    dense = pattern.index(1) if 1 in pattern else layers
    if pattern != [0] * dense + [1] * (layers - dense):
        raise ConversionError(f"--moe-layer-freq {freq}: DeepSeek-V2 has its dense layers first, then experts in "
                              f"every layer (first_k_dense_replace)")
    moe_ffn, shared = g("moe_ffn_hidden_size") or g("ffn_hidden_size"), g("moe_shared_expert_intermediate_size") or 0
    if shared % moe_ffn:
        raise ConversionError(f"--moe-shared-expert-intermediate-size {shared}: DeepSeek-V2's shared experts are "
                              f"n_shared_experts x moe_intermediate_size ({moe_ffn}) wide")
    rope = {"rope_type": "default", "rope_theta": float(g("rotary_base"))}
    if g("rope_type") == "yarn":
        rope.update(rope_type="yarn", factor=g("rotary_scaling_factor"),
                    original_max_position_embeddings=g("original_max_position_embeddings"), beta_fast=g("beta_fast"),
                    beta_slow=g("beta_slow"), mscale=g("mscale"), mscale_all_dim=g("mscale_all_dim"))
    heads = g("num_attention_heads")
    c = DeepseekV2Config(vocab_size=vocab, hidden_size=g("hidden_size"), intermediate_size=g("ffn_hidden_size"),
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=g("max_position_embeddings"), rms_norm_eps=g("norm_epsilon"),
                         tie_word_embeddings=not g("untie_embeddings_and_output_weights"), rope_parameters=rope,
                         attention_dropout=g("attention_dropout"), q_lora_rank=g("q_lora_rank"),
                         kv_lora_rank=g("kv_lora_rank"), qk_nope_head_dim=g("qk_head_dim"),
                         qk_rope_head_dim=g("qk_pos_emb_head_dim"), v_head_dim=g("v_head_dim"),
                         n_routed_experts=g("num_experts"), num_experts_per_tok=g("moe_router_topk"),
                         n_shared_experts=shared // moe_ffn, moe_intermediate_size=moe_ffn, first_k_dense_replace=dense,
                         routed_scaling_factor=g("moe_router_topk_scaling_factor") or 1.0, topk_method="greedy",
                         hidden_act="silu", bos_token_id=eod, eos_token_id=eod, architectures=["DeepseekV2ForCausalLM"])
    return c.to_dict()


FAMILY = Family(TABLE, model_types=("deepseek_v2",), engine_families=("deepseek_v2",), engine_args=engine_args,
                hf_config=hf_config)
