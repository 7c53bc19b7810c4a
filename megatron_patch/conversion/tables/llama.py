"""Llama (2 and 3.x), Qwen2/2.5, Qwen3 and Mistral (Hugging Face `LlamaForCausalLM`, `Qwen2ForCausalLM`,
`Qwen3ForCausalLM`, `MistralForCausalLM`) <-> the engine's llama/llama3/qwen2/qwen3/mistral families: RoPE,
RMSNorm, SwiGLU, grouped-query attention. Qwen2 adds QKV biases; Qwen3 adds an RMSNorm over each query and key
head (`q_norm`/`k_norm` -> `q_layernorm`/`k_layernorm`) and decouples the head dimension from the width; Llama
3.1-3.3 scale RoPE (rope_type "llama3"). They share their tensor names; their configs differ in a few fields.

Every field of a config.json that changes the model is mapped or refused here (`engine_args`): the activation,
biases, sliding windows, RoPE type and its parameters, head dimension, tied embeddings."""
from __future__ import annotations

from typing import Dict, Optional

from ..family import Family
from ..mapping import QK_NORM, QKV_BIAS, UNTIED, ConversionError, Rule, Table
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
    Rule(L + "self_attention.q_layernorm.weight", (H + "self_attn.q_norm.weight",), when=QK_NORM),
    Rule(L + "self_attention.k_layernorm.weight", (H + "self_attn.k_norm.weight",), when=QK_NORM),
    Rule(L + "self_attention.linear_proj.weight", (H + "self_attn.o_proj.weight",)),
    Rule(L + "pre_mlp_layernorm.weight", (H + "post_attention_layernorm.weight",)),
    Rule(L + "mlp.linear_fc1.weight", (H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight"), FUSE_GATE_UP),
    Rule(L + "mlp.linear_fc2.weight", (H + "mlp.down_proj.weight",)),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Rule("output_layer.weight", ("lm_head.weight",), PAD_VOCAB, when=UNTIED),
), ignored_hf=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",  # a buffer of older checkpoints
               r"lm_head\.weight"))  # a tied copy of embed_tokens, where a checkpoint stores it
ARCHITECTURES = {"llama": "LlamaForCausalLM", "llama3": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}
# Llama 3.x's RoPE scaling: config.json's rope parameter -> the engine's field
LLAMA3_ROPE = {"factor": "rope_scaling_factor", "low_freq_factor": "rope_scaling_low_freq_factor",
               "high_freq_factor": "rope_scaling_high_freq_factor",
               "original_max_position_embeddings": "rope_scaling_original_max_position_embeddings"}


def rope_parameters(c: Dict) -> Dict:
    """The RoPE parameters of a config.json, whichever transformers wrote it: 5.x nests the base and the scaling
    in `rope_parameters` (`rope_scaling` is its alias), 4.x has `rope_theta` beside a `rope_scaling` dict (whose
    type key was `type` before `rope_type`). A scaling next to a default `rope_parameters` still counts."""
    params = dict(c.get("rope_parameters") or {})
    scaling = dict(c.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    merged = {**params, **{k: v for k, v in scaling.items() if v is not None}}
    if params.get("rope_type") not in (None, "default") and scaling.get("rope_type") in (None, "default"):
        merged["rope_type"] = params["rope_type"]
    merged.setdefault("rope_type", "default")
    merged.setdefault("rope_theta", c.get("rope_theta", 10000.0))
    return merged


def rope_args(c: Dict, scalings=("llama3",)) -> Dict:
    """Engine fields of a config.json's RoPE: its base, and Llama 3.x's scaling with all four of its parameters
    where the family allows it. Any other RoPE type is refused: the positions would be encoded differently."""
    p = rope_parameters(c)
    kind = p["rope_type"]
    if kind not in ("default", *scalings):
        allowed = " or ".join(repr(k) for k in ("default", *scalings))
        raise ConversionError(f"config.json rope type {kind!r}: the engine implements RoPE of type {allowed} for "
                              f"model_type {c.get('model_type')!r}; this model's positions would be encoded "
                              f"differently")
    args = dict(rotary_base=float(p["rope_theta"]), use_rope_scaling=kind == "llama3")
    if kind == "llama3":
        missing = [k for k in LLAMA3_ROPE if p.get(k) is None]
        if missing:
            raise ConversionError(f"config.json rope type 'llama3' lacks {', '.join(missing)}: Llama 3.x's scaling "
                                  f"needs factor, low_freq_factor, high_freq_factor and original_max_position_embeddings")
        if p.get("attention_factor") not in (None, 1.0, 1):
            raise ConversionError(f"config.json rope attention_factor {p['attention_factor']}: Llama 3.x's scaling "
                                  f"leaves attention unscaled (1.0); the engine does not scale it")
        if float(p["high_freq_factor"]) <= float(p["low_freq_factor"]):
            raise ConversionError(f"config.json rope high_freq_factor {p['high_freq_factor']} must exceed "
                                  f"low_freq_factor {p['low_freq_factor']}")
        args.update({field: type(0 if "original" in key else 0.0)(p[key]) for key, field in LLAMA3_ROPE.items()})
    return args


def engine_args(c: Dict) -> Dict:
    """Engine Config fields that make the model of a Llama/Qwen2/Qwen3/Mistral config.json."""
    family = c["model_type"]
    if c.get("hidden_act", "silu") != "silu":
        raise ConversionError(f"config.json hidden_act {c['hidden_act']!r}: the engine's SwiGLU uses silu")
    if c.get("mlp_bias") or (family != "qwen2" and c.get("attention_bias")):
        raise ConversionError("config.json mlp_bias/attention_bias: biases on every projection (the output "
                              "projection's too) are not supported; the engine has Qwen2's QKV biases only")
    if c.get("use_sliding_window") or any(t != "full_attention" for t in c.get("layer_types") or ()):
        raise ConversionError("config.json use_sliding_window/layer_types: the engine has no sliding-window "
                              "attention; every layer must be full_attention")
    if (c.get("pretraining_tp") or 1) != 1:
        raise ConversionError(f"config.json pretraining_tp {c['pretraining_tp']}: transformers then computes the "
                              f"projections in slices (slightly different numbers); set it to 1")
    heads, hidden = c["num_attention_heads"], c["hidden_size"]
    head_dim = c.get("head_dim") or hidden // heads
    args = dict(model_family=family, num_layers=c["num_hidden_layers"], hidden_size=hidden, num_attention_heads=heads,
                num_query_groups=c.get("num_key_value_heads") or heads, ffn_hidden_size=c["intermediate_size"],
                kv_channels=None if head_dim * heads == hidden else head_dim,
                max_position_embeddings=c["max_position_embeddings"], position_embedding_type="rope",
                normalization="RMSNorm", norm_epsilon=c.get("rms_norm_eps", 1e-6),
                swiglu=True, openai_gelu=False, untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", False),
                disable_bias_linear=True, add_qkv_bias=family == "qwen2", qk_layernorm=family == "qwen3", hidden_dropout=0.0,
                attention_dropout=c.get("attention_dropout", 0.0), model_vocab_size=c["vocab_size"],
                **rope_args(c, scalings=("llama3",) if family == "llama" else ()))
    if family == "llama" and args["use_rope_scaling"]:
        args["model_family"] = "llama3"
    return args


def _rope_parameters(g) -> Dict:
    """config.json's rope_parameters of the engine model read by `g`."""
    params = {"rope_type": "default", "rope_theta": float(g("rotary_base"))}
    if g("use_rope_scaling"):
        params.update(rope_type="llama3", **{key: g(field) for key, field in LLAMA3_ROPE.items()})
    return params


def hf_config(cfg, vocab: int, eod: Optional[int]) -> Dict:
    """config.json fields of the engine model `cfg` (a Config or its dict); `eod` as in gpt2.hf_config."""
    import transformers

    g = cfg.get if isinstance(cfg, dict) else lambda k: getattr(cfg, k)
    family = g("model_family")
    if family not in ARCHITECTURES:  # an architecture given by flags: what its fields make it
        family = "qwen3" if g("qk_layernorm") else "qwen2" if g("add_qkv_bias") else "llama"
    if g("qk_layernorm") and family != "qwen3":
        raise ConversionError(f"a {family} model with --qk-layernorm has no Hugging Face equivalent: export it as "
                              f"--model-family qwen3")
    if g("use_rope_scaling") and family not in ("llama", "llama3"):
        raise ConversionError(f"a {family} model with --use-rope-scaling has no Hugging Face equivalent (only "
                              f"Llama 3.x scales RoPE so)")
    arch = ARCHITECTURES[family]
    cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    heads = g("num_attention_heads")
    kw = dict(vocab_size=vocab, hidden_size=g("hidden_size"), intermediate_size=g("ffn_hidden_size"),
              num_hidden_layers=g("num_layers"), num_attention_heads=heads,
              num_key_value_heads=g("num_query_groups") or heads, max_position_embeddings=g("max_position_embeddings"),
              rms_norm_eps=g("norm_epsilon"), tie_word_embeddings=not g("untie_embeddings_and_output_weights"),
              rope_parameters=_rope_parameters(g),
              attention_dropout=g("attention_dropout"), head_dim=g("kv_channels") or g("hidden_size") // heads,
              hidden_act="silu", bos_token_id=eod, eos_token_id=eod, architectures=[arch])
    if family == "mistral":
        kw["sliding_window"] = None
    if family == "qwen3" and g("add_qkv_bias"):
        raise ConversionError("a qwen3 model with --add-qkv-bias: Qwen3's attention_bias puts a bias on the output "
                              "projection too, which the engine's model does not have")
    return cls(**kw).to_dict()


FAMILY = Family(TABLE, model_types=("llama", "qwen2", "qwen3", "mistral"),
                engine_families=("llama", "llama3", "qwen2", "qwen3", "mistral"), engine_args=engine_args,
                hf_config=hf_config)
