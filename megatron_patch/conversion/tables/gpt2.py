"""GPT-2 (Hugging Face `GPT2LMHeadModel`) <-> the engine's `gpt` family."""
from __future__ import annotations

from typing import Dict, Optional

from ..family import Family
from ..mapping import UNTIED, ConversionError, Rule, Table
from ..transforms import CONV1D_QKV, PAD_VOCAB, TRANSPOSE

L = "decoder.layers.{i}."
H = "transformer.h.{i}."

TABLE = Table("gpt2", (
    Rule("embedding.word_embeddings.weight", ("transformer.wte.weight",), PAD_VOCAB),
    Rule("embedding.position_embeddings.weight", ("transformer.wpe.weight",)),
    Rule(L + "input_layernorm.weight", (H + "ln_1.weight",)),
    Rule(L + "input_layernorm.bias", (H + "ln_1.bias",)),
    Rule(L + "self_attention.linear_qkv.weight", (H + "attn.c_attn.weight",), CONV1D_QKV),
    Rule(L + "self_attention.linear_qkv.bias", (H + "attn.c_attn.bias",), CONV1D_QKV),
    Rule(L + "self_attention.linear_proj.weight", (H + "attn.c_proj.weight",), TRANSPOSE),
    Rule(L + "self_attention.linear_proj.bias", (H + "attn.c_proj.bias",)),
    Rule(L + "pre_mlp_layernorm.weight", (H + "ln_2.weight",)),
    Rule(L + "pre_mlp_layernorm.bias", (H + "ln_2.bias",)),
    Rule(L + "mlp.linear_fc1.weight", (H + "mlp.c_fc.weight",), TRANSPOSE),
    Rule(L + "mlp.linear_fc1.bias", (H + "mlp.c_fc.bias",)),
    Rule(L + "mlp.linear_fc2.weight", (H + "mlp.c_proj.weight",), TRANSPOSE),
    Rule(L + "mlp.linear_fc2.bias", (H + "mlp.c_proj.bias",)),
    Rule("decoder.final_layernorm.weight", ("transformer.ln_f.weight",)),
    Rule("decoder.final_layernorm.bias", ("transformer.ln_f.bias",)),
    Rule("output_layer.weight", ("lm_head.weight",), PAD_VOCAB, when=UNTIED),
), ignored_hf=(r"transformer\.h\.\d+\.attn\.(bias|masked_bias)",  # causal-mask buffers of older checkpoints
               r"lm_head\.weight"))  # a tied copy of wte, where a checkpoint stores it

# GPT-2's activation names -> the engine's --openai-gelu (the tanh approximation) or exact GELU
ACTIVATIONS = {"gelu_new": True, "gelu_pytorch_tanh": True, "gelu_fast": True, "gelu": False}


def engine_args(c: Dict) -> Dict:
    """Engine Config fields that make the model of a GPT-2 config.json."""
    act = c.get("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        raise ConversionError(f"config.json activation_function {act!r}: the engine supports {', '.join(ACTIVATIONS)}")
    if not c.get("scale_attn_weights", True) or c.get("scale_attn_by_inverse_layer_idx", False):
        raise ConversionError("config.json: scale_attn_weights=false / scale_attn_by_inverse_layer_idx=true change "
                              "the attention scale, which the engine does not support")
    hidden = c["n_embd"]
    return dict(model_family="gpt", num_layers=c["n_layer"], hidden_size=hidden, num_attention_heads=c["n_head"],
                num_query_groups=None, ffn_hidden_size=c.get("n_inner") or 4 * hidden, kv_channels=None,
                max_position_embeddings=c["n_positions"], position_embedding_type="learned_absolute",
                normalization="LayerNorm", norm_epsilon=c.get("layer_norm_epsilon", 1e-5), swiglu=False,
                openai_gelu=ACTIVATIONS[act], untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", True),
                disable_bias_linear=False, add_qkv_bias=False, hidden_dropout=c.get("resid_pdrop", 0.1),
                attention_dropout=c.get("attn_pdrop", 0.1), model_vocab_size=c["vocab_size"])


def hf_config(cfg, vocab: int, eod: Optional[int]) -> Dict:
    """config.json fields of the engine model `cfg` (a Config or its dict); `eod`: its tokenizer's
    end-of-document id, named as bos/eos (None: none)."""
    from transformers import GPT2Config

    g = cfg.get if isinstance(cfg, dict) else lambda k: getattr(cfg, k)
    c = GPT2Config(vocab_size=vocab, n_positions=g("max_position_embeddings") or g("seq_length"), n_embd=g("hidden_size"),
                   n_layer=g("num_layers"), n_head=g("num_attention_heads"),
                   n_inner=g("ffn_hidden_size") or 4 * g("hidden_size"),
                   activation_function="gelu_new" if g("openai_gelu") else "gelu",
                   layer_norm_epsilon=g("norm_epsilon"), resid_pdrop=g("hidden_dropout"), embd_pdrop=g("hidden_dropout"),
                   attn_pdrop=g("attention_dropout"), tie_word_embeddings=not g("untie_embeddings_and_output_weights"),
                   bos_token_id=eod, eos_token_id=eod, architectures=["GPT2LMHeadModel"])
    return c.to_dict()


FAMILY = Family(TABLE, model_types=("gpt2",), engine_families=("gpt", "gpt2"), engine_args=engine_args,
                hf_config=hf_config,
                hf_prefix="transformer.")  # checkpoints of GPT2Model (the hub's gpt2) store names without it
