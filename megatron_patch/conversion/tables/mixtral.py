"""Mixtral (Hugging Face `MixtralForCausalLM`) <-> the engine's mixtral family: Mistral's attention and
norms (the llama table's rules), and in every layer a sparse block of SwiGLU experts behind a router.

Checkpoint names are those `save_pretrained` writes (transformers 5 keeps the experts fused in memory,
`mlp.experts.gate_up_proj` [E, 2I, H], but saves them per expert, as the hub's checkpoints are):
`block_sparse_moe.gate.weight` [E, H] is megatron-core's `mlp.router.weight`; expert e's w1 (gate), w3 (up)
and w2 (down) are `mlp.experts.local_experts.{e}.linear_fc1.weight` ([w1; w3], SwiGLU's [gate; up]) and
`linear_fc2.weight`, with global expert numbers (an EP rank holds a contiguous block of them).

Routing: Mixtral takes softmax over the experts, keeps the top k and renormalises them; megatron-core without
--moe-router-pre-softmax takes the top k logits and a softmax over them: the same experts and weights (to
rounding), so the router weight moves unchanged.
"""
from __future__ import annotations

from typing import Dict, Optional

from ..family import Family
from ..mapping import ConversionError, Rule, Table
from ..transforms import FUSE_GATE_UP
from . import llama

L = "decoder.layers.{i}."
H = "model.layers.{i}."
E = "mlp.experts.local_experts.{e}."
X = "block_sparse_moe.experts.{e}."

ATTENTION_AND_NORMS = tuple(r for r in llama.TABLE.rules if ".mlp." not in r.mcore)  # every rule but the MLP's

TABLE = Table("mixtral", ATTENTION_AND_NORMS + (
    Rule(L + "mlp.router.weight", (H + "block_sparse_moe.gate.weight",), layers="moe"),
    Rule(L + E + "linear_fc1.weight", (H + X + "w1.weight", H + X + "w3.weight"), FUSE_GATE_UP, layers="moe"),
    Rule(L + E + "linear_fc2.weight", (H + X + "w2.weight",), layers="moe"),
), ignored_hf=llama.TABLE.ignored_hf)


def engine_args(c: Dict) -> Dict:
    """Engine Config fields that make the model of a Mixtral config.json."""
    args = llama.engine_args(dict(c, model_type="mistral"))  # attention, norms, RoPE: Mistral's checks and fields
    experts, topk = c["num_local_experts"], c["num_experts_per_tok"]
    if not 1 <= topk <= experts:
        raise ConversionError(f"config.json num_experts_per_tok {topk} must be between 1 and num_local_experts "
                              f"{experts}")
    args.update(model_family="mixtral", num_experts=experts, moe_router_topk=topk,
                moe_ffn_hidden_size=c["intermediate_size"], moe_layer_freq=1, moe_router_pre_softmax=False,
                moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False,
                # a training setting, taken like dropout: HF adds this loss only with output_router_logits
                moe_aux_loss_coeff=c.get("router_aux_loss_coef", 0.0) if c.get("output_router_logits") else 0.0)
    return args


def hf_config(cfg, vocab: int, eod: Optional[int]) -> Dict:
    """config.json of the engine model `cfg` (a Config or its dict); `eod` as in gpt2.hf_config."""
    from transformers import MixtralConfig

    g = cfg.get if isinstance(cfg, dict) else lambda k: getattr(cfg, k)
    if g("moe_layer_freq") != 1 or g("moe_shared_expert_intermediate_size") or g("add_qkv_bias"):
        raise ConversionError("this model is not a Mixtral: Mixtral has experts in every layer (--moe-layer-freq 1), "
                              "no shared expert and no QKV biases")
    if g("moe_router_pre_softmax"):
        raise ConversionError("--moe-router-pre-softmax weights the experts by their softmax probabilities without "
                              "renormalising; Mixtral renormalises the top k (train without the flag)")
    heads = g("num_attention_heads")
    c = MixtralConfig(vocab_size=vocab, hidden_size=g("hidden_size"),
                      intermediate_size=g("moe_ffn_hidden_size") or g("ffn_hidden_size"),
                      num_hidden_layers=g("num_layers"), num_attention_heads=heads,
                      num_key_value_heads=g("num_query_groups") or heads,
                      head_dim=g("kv_channels") or g("hidden_size") // heads,
                      max_position_embeddings=g("max_position_embeddings"), rms_norm_eps=g("norm_epsilon"),
                      tie_word_embeddings=not g("untie_embeddings_and_output_weights"),
                      rope_parameters={"rope_type": "default", "rope_theta": float(g("rotary_base"))},
                      attention_dropout=g("attention_dropout"), num_local_experts=g("num_experts"),
                      num_experts_per_tok=g("moe_router_topk"), router_aux_loss_coef=g("moe_aux_loss_coeff"),
                      sliding_window=None, hidden_act="silu", bos_token_id=eod, eos_token_id=eod,
                      architectures=["MixtralForCausalLM"])
    return c.to_dict()


FAMILY = Family(TABLE, model_types=("mixtral",), engine_families=("mixtral",), engine_args=engine_args,
                hf_config=hf_config)
