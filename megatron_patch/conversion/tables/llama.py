"""Llama, Qwen2 and Mistral (Hugging Face `LlamaForCausalLM`, `Qwen2ForCausalLM`, `MistralForCausalLM`) <->
the engine's llama/qwen2/mistral families: RoPE, RMSNorm, SwiGLU, grouped-query attention; Qwen2 adds
QKV biases. The three share their tensor names; their configs differ in a few fields."""
from __future__ import annotations

from typing import Dict, Optional

from ..family import Family
from ..mapping import QKV_BIAS, UNTIED, ConversionError, Rule, Table
from ..transforms import FUSE_GATE_UP, FUSE_QKV, PAD_VOCAB

L = "decoder.layers.{i}."
H = "model.layers.{i}."

TABLE = Table("llama", (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), PAD_VOCAB),
    Rule(L + "input_layernorm.weight", (H + "input_layernorm.weight",)),
    Rule(L + "self_attention.linear_qkv.weight",
         (H + "self_attn.q_proj.weight", H + "self_attn.k_proj.weight", H + "self_attn.v_proj.weight"), FUSE_QKV),
    Rule(L + "self_attention.linear_qkv.bias",
         (H + "self_attn.q_proj.bias", H + "self_attn.k_proj.bias", H + "self_attn.v_proj.bias"), FUSE_QKV,
         when=QKV_BIAS),
    Rule(L + "self_attention.linear_proj.weight", (H + "self_attn.o_proj.weight",)),
    Rule(L + "pre_mlp_layernorm.weight", (H + "post_attention_layernorm.weight",)),
    Rule(L + "mlp.linear_fc1.weight", (H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight"), FUSE_GATE_UP),
    Rule(L + "mlp.linear_fc2.weight", (H + "mlp.down_proj.weight",)),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Rule("output_layer.weight", ("lm_head.weight",), PAD_VOCAB, when=UNTIED),
), ignored_hf=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",  # a buffer of older checkpoints
               r"lm_head\.weight"))  # a tied copy of embed_tokens, where a checkpoint stores it
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}


def rope_theta(c: Dict) -> float:
    """RoPE base of a config.json (transformers >= 5 nests it in rope_parameters); only unscaled RoPE."""
    params = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or {}
    # transformers applies a rope_scaling even next to a default rope_parameters: any non-default type counts
    kinds = [k for k in (scaling.get("rope_type"), scaling.get("type"), params.get("rope_type")) if k]
    kind = next((k for k in kinds if k != "default"), "default")
    if kind != "default":
        raise ConversionError(f"config.json rope type {kind!r}: the engine implements unscaled RoPE only "
                              f"(rope_type 'default'); this model's positions would be encoded differently")
    return float(params.get("rope_theta", c.get("rope_theta", 10000.0)))


def engine_args(c: Dict) -> Dict:
    """Engine Config fields that make the model of a Llama/Qwen2/Mistral config.json."""
    family = c["model_type"]
    if c.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"config.json hidden_act {c['hidden_act']!r}: the engine's SwiGLU uses silu")
    if c.get("mlp_bias") or (family == "llama" and c.get("attention_bias")):
        raise ConversionError("config.json mlp_bias/attention_bias: biases on every projection are not supported "
                              "for this family (only Qwen2's QKV biases)")
    if c.get("use_sliding_window"):
        raise ConversionError("config.json use_sliding_window=true: the engine has no sliding-window attention")
    heads, hidden = c["num_attention_heads"], c["hidden_size"]
    head_dim = c.get("head_dim") or hidden // heads
    return dict(model_family=family, num_layers=c["num_hidden_layers"], hidden_size=hidden, num_attention_heads=heads,
                num_query_groups=c.get("num_key_value_heads") or heads, ffn_hidden_size=c["intermediate_size"],
                kv_channels=None if head_dim * heads == hidden else head_dim,
                max_position_embeddings=c["max_position_embeddings"], position_embedding_type="rope",
                rotary_base=rope_theta(c), normalization="RMSNorm", norm_epsilon=c.get("rms_norm_eps", 1e-6),
                swiglu=True, openai_gelu=False, untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", False),
                disable_bias_linear=True, add_qkv_bias=family == "qwen2", hidden_dropout=0.0,
                attention_dropout=c.get("attention_dropout", 0.0), model_vocab_size=c["vocab_size"])


def hf_config(cfg, vocab: int, eod: Optional[int]) -> Dict:
    """config.json fields of the engine model `cfg` (a Config or its dict); `eod` as in gpt2.hf_config."""
    import transformers

    g = cfg.get if isinstance(cfg, dict) else lambda k: getattr(cfg, k)
    family = g("model_family") if g("model_family") in ARCHITECTURES else ("qwen2" if g("add_qkv_bias") else "llama")
    arch = ARCHITECTURES[family]
    cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    heads = g("num_attention_heads")
    kw = dict(vocab_size=vocab, hidden_size=g("hidden_size"), intermediate_size=g("ffn_hidden_size"),
              num_hidden_layers=g("num_layers"), num_attention_heads=heads,
              num_key_value_heads=g("num_query_groups") or heads, max_position_embeddings=g("max_position_embeddings"),
              rms_norm_eps=g("norm_epsilon"), tie_word_embeddings=not g("untie_embeddings_and_output_weights"),
              rope_parameters={"rope_type": "default", "rope_theta": float(g("rotary_base"))},
              attention_dropout=g("attention_dropout"), head_dim=g("kv_channels") or g("hidden_size") // heads,
              hidden_act="silu", bos_token_id=eod, eos_token_id=eod, architectures=[arch])
    if family == "mistral":
        kw["sliding_window"] = None
    return cls(**kw).to_dict()


FAMILY = Family(TABLE, model_types=("llama", "qwen2", "mistral"), engine_families=("llama", "qwen2", "mistral"),
                engine_args=engine_args, hf_config=hf_config)
