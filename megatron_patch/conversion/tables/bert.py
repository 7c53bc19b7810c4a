"""BERT (Hugging Face `BertModel`, `BertForMaskedLM`, `BertForPreTraining`) <-> the engine's post-LN `bert` family
(megatron_patch/models/bert.py).

A bare `BertModel` checkpoint (e.g. MiniLM, sentence-transformers) names its tensors without `bert.` and has
no MLM/NSP heads: the prefix is restored on reading (hf_prefix), and the heads it lacks are optional parts,
initialised on import and reported. The export always has the MLM head (and with the binary head the pooler
and NSP head), so it is written as BertForPreTraining (or BertForMaskedLM), which transformers' BertModel
also loads (it drops the heads and the `bert.` prefix).
"""
from __future__ import annotations

from typing import Dict, Optional

from ..family import Family
from ..mapping import BINARY_HEAD, UNTIED, ConversionError, Rule, Table
from ..transforms import FUSE_QKV, PAD_VOCAB

L = "encoder.layers.{i}."
H = "bert.encoder.layer.{i}."
E = "bert.embeddings."
MLM = "cls.predictions."

TABLE = Table("bert", (
    Rule("embedding.word_embeddings.weight", (E + "word_embeddings.weight",), PAD_VOCAB),
    Rule("embedding.position_embeddings.weight", (E + "position_embeddings.weight",)),
    Rule("embedding.tokentype_embeddings.weight", (E + "token_type_embeddings.weight",)),
    Rule("embedding.layernorm.weight", (E + "LayerNorm.weight",)),
    Rule("embedding.layernorm.bias", (E + "LayerNorm.bias",)),
    Rule(L + "self_attention.linear_qkv.weight",
         (H + "attention.self.query.weight", H + "attention.self.key.weight", H + "attention.self.value.weight"),
         FUSE_QKV),
    Rule(L + "self_attention.linear_qkv.bias",
         (H + "attention.self.query.bias", H + "attention.self.key.bias", H + "attention.self.value.bias"), FUSE_QKV),
    Rule(L + "self_attention.linear_proj.weight", (H + "attention.output.dense.weight",)),
    Rule(L + "self_attention.linear_proj.bias", (H + "attention.output.dense.bias",)),
    Rule(L + "post_attention_layernorm.weight", (H + "attention.output.LayerNorm.weight",)),
    Rule(L + "post_attention_layernorm.bias", (H + "attention.output.LayerNorm.bias",)),
    Rule(L + "mlp.linear_fc1.weight", (H + "intermediate.dense.weight",)),
    Rule(L + "mlp.linear_fc1.bias", (H + "intermediate.dense.bias",)),
    Rule(L + "mlp.linear_fc2.weight", (H + "output.dense.weight",)),
    Rule(L + "mlp.linear_fc2.bias", (H + "output.dense.bias",)),
    Rule(L + "post_mlp_layernorm.weight", (H + "output.LayerNorm.weight",)),
    Rule(L + "post_mlp_layernorm.bias", (H + "output.LayerNorm.bias",)),
    # the masked-LM head: transform (dense, gelu, LayerNorm), then the (tied) decoder and its bias
    Rule("lm_head.dense.weight", (MLM + "transform.dense.weight",), part="MLM head"),
    Rule("lm_head.dense.bias", (MLM + "transform.dense.bias",), part="MLM head"),
    Rule("lm_head.layer_norm.weight", (MLM + "transform.LayerNorm.weight",), part="MLM head"),
    Rule("lm_head.layer_norm.bias", (MLM + "transform.LayerNorm.bias",), part="MLM head"),
    Rule("output_layer.bias", (MLM + "bias",), PAD_VOCAB, part="MLM head"),
    Rule("output_layer.weight", (MLM + "decoder.weight",), PAD_VOCAB, when=UNTIED, part="MLM head"),
    # the binary head: pooler (dense + tanh on [CLS]) and next-sentence classifier
    Rule("pooler.dense.weight", ("bert.pooler.dense.weight",), when=BINARY_HEAD, part="pooler"),
    Rule("pooler.dense.bias", ("bert.pooler.dense.bias",), when=BINARY_HEAD, part="pooler"),
    Rule("binary_head.weight", ("cls.seq_relationship.weight",), when=BINARY_HEAD, part="NSP head"),
    Rule("binary_head.bias", ("cls.seq_relationship.bias",), when=BINARY_HEAD, part="NSP head"),
), ignored_hf=(r"bert\.embeddings\.position_ids",  # the arange buffer of older checkpoints
               r"cls\.predictions\.decoder\.weight",  # a tied copy of word_embeddings, where a checkpoint stores it
               r"cls\.predictions\.decoder\.bias"))  # the same tensor as cls.predictions.bias (tied)

SUPPORTED = "absolute position embeddings, hidden_act 'gelu' (exact), type_vocab_size 2, an encoder (no decoder)"


def engine_args(c: Dict) -> Dict:
    """Engine Config fields that make the model of a BERT config.json; ConversionError for what the engine's
    post-LN BERT does not compute the same way."""
    from megatron_patch.models.bert import NUM_TOKENTYPES

    problems = []
    if c.get("hidden_act", "gelu") != "gelu":
        problems.append(f"hidden_act {c['hidden_act']!r} (the engine's MLP and MLM head use exact GELU, 'gelu')")
    if c.get("position_embedding_type", "absolute") != "absolute":
        problems.append(f"position_embedding_type {c['position_embedding_type']!r} (only 'absolute')")
    if c.get("type_vocab_size", NUM_TOKENTYPES) != NUM_TOKENTYPES:
        problems.append(f"type_vocab_size {c['type_vocab_size']} (the engine has {NUM_TOKENTYPES} token types)")
    if c.get("is_decoder") or c.get("add_cross_attention"):
        problems.append("is_decoder/add_cross_attention (the engine's BERT is an encoder)")
    if c["hidden_size"] % c["num_attention_heads"]:
        problems.append(f"hidden_size {c['hidden_size']} not divisible by num_attention_heads {c['num_attention_heads']}")
    if problems:
        raise ConversionError(f"config.json: {'; '.join(problems)}: not supported. The engine's BERT supports "
                              f"{SUPPORTED}")
    return dict(model_family="bert", num_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"],
                num_attention_heads=c["num_attention_heads"], num_query_groups=None,
                ffn_hidden_size=c["intermediate_size"], kv_channels=None,
                max_position_embeddings=c["max_position_embeddings"], position_embedding_type="learned_absolute",
                normalization="LayerNorm", norm_epsilon=c.get("layer_norm_eps", 1e-12), swiglu=False, openai_gelu=False,
                untie_embeddings_and_output_weights=not c.get("tie_word_embeddings", True), disable_bias_linear=False,
                add_qkv_bias=False, hidden_dropout=c.get("hidden_dropout_prob", 0.1),
                attention_dropout=c.get("attention_probs_dropout_prob", 0.1),
                init_method_std=c.get("initializer_range", 0.02), model_vocab_size=c["vocab_size"])


def architectures(cfg) -> list:
    """The transformers class of an export: the engine's BERT always has the MLM head."""
    g = cfg.get if isinstance(cfg, dict) else lambda k: getattr(cfg, k, None)
    return ["BertForMaskedLM"] if g("bert_binary_head") is False else ["BertForPreTraining"]


def export_config(hf_config: Dict, cfg) -> Dict:
    """config.json of an export from a converted model: the original's, naming the class its tensors make."""
    return {**hf_config, "architectures": architectures(cfg)}


def hf_config(cfg, vocab: int, eod: Optional[int]) -> Dict:
    """config.json fields of the engine model `cfg` (a Config or its dict); `eod` is unused (BERT has no
    end-of-document token in its config)."""
    from transformers import BertConfig

    g = cfg.get if isinstance(cfg, dict) else lambda k: getattr(cfg, k)
    c = BertConfig(vocab_size=vocab, hidden_size=g("hidden_size"), num_hidden_layers=g("num_layers"),
                   num_attention_heads=g("num_attention_heads"), intermediate_size=g("ffn_hidden_size") or 4 * g("hidden_size"),
                   hidden_act="gelu", hidden_dropout_prob=g("hidden_dropout"),
                   attention_probs_dropout_prob=g("attention_dropout"),
                   max_position_embeddings=g("max_position_embeddings") or g("seq_length"), type_vocab_size=2,
                   layer_norm_eps=g("norm_epsilon"), initializer_range=g("init_method_std"),
                   tie_word_embeddings=not g("untie_embeddings_and_output_weights"), architectures=architectures(cfg))
    return c.to_dict()


FAMILY = Family(TABLE, model_types=("bert",), engine_families=("bert",), engine_args=engine_args, hf_config=hf_config,
                hf_prefix="bert.",  # a bare BertModel's checkpoint names its tensors without it
                export_config=export_config)
