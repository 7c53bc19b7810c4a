"""Model families (`--model-family`) and sizes (`--model-size`). Explicit flags override a preset."""
from __future__ import annotations

from typing import Dict

# Architecture of each family: what makes a Llama a Llama.
FAMILIES: Dict[str, Dict[str, object]] = {
    "gpt": dict(position_embedding_type="learned_absolute", swiglu=False, normalization="LayerNorm",
                untie_embeddings_and_output_weights=False, disable_bias_linear=False),
    "llama": dict(position_embedding_type="rope", swiglu=True, normalization="RMSNorm",
                  untie_embeddings_and_output_weights=True, disable_bias_linear=True, norm_epsilon=1e-5,
                  hidden_dropout=0.0, attention_dropout=0.0),
    "qwen2": dict(position_embedding_type="rope", swiglu=True, normalization="RMSNorm", rotary_base=1000000,
                  untie_embeddings_and_output_weights=True, disable_bias_linear=True, add_qkv_bias=True, norm_epsilon=1e-6,
                  hidden_dropout=0.0, attention_dropout=0.0),
    "mistral": dict(position_embedding_type="rope", swiglu=True, normalization="RMSNorm",
                    untie_embeddings_and_output_weights=True, disable_bias_linear=True, norm_epsilon=1e-5,
                    hidden_dropout=0.0, attention_dropout=0.0),
    # Hugging Face BERT: post-LayerNorm, exact GELU, tied output layer, 512 positions, eps 1e-12.
    "bert": dict(position_embedding_type="learned_absolute", swiglu=False, normalization="LayerNorm",
                 untie_embeddings_and_output_weights=False, disable_bias_linear=False, norm_epsilon=1e-12,
                 max_position_embeddings=512),
}

# (num_layers, hidden_size, num_attention_heads, num_query_groups or None, ffn_hidden_size or None)
SIZES: Dict[str, Dict[str, tuple]] = {
    "gpt": {"tiny": (2, 128, 4, None, None), "125m": (12, 768, 12, None, None), "350m": (24, 1024, 16, None, None),
            "760m": (24, 1536, 16, None, None), "1.3b": (24, 2048, 16, None, None), "2.7b": (32, 2560, 32, None, None)},
    "llama": {"tiny": (2, 128, 4, 2, 352), "1.3b": (24, 2048, 16, None, 5504), "7b": (32, 4096, 32, None, 11008),
              "13b": (40, 5120, 40, None, 13824), "8b": (32, 4096, 32, 8, 14336)},
    "qwen2": {"tiny": (2, 128, 4, 2, 352), "0.5b": (24, 896, 14, 2, 4864), "1.5b": (28, 1536, 12, 2, 8960),
              "7b": (28, 3584, 28, 4, 18944)},
    "mistral": {"tiny": (2, 128, 4, 2, 352), "7b": (32, 4096, 32, 8, 14336)},
    "bert": {"tiny": (2, 128, 4, None, None), "base": (12, 768, 12, None, None), "large": (24, 1024, 16, None, None)},
}


def preset(family: str, size: str) -> Dict[str, object]:
    """Flag values of a family/size preset, or ValueError naming the choices."""
    if family not in FAMILIES:
        raise ValueError(f"--model-family {family!r}: choose one of {', '.join(FAMILIES)}")
    values = dict(FAMILIES[family])
    if size is not None:
        if size not in SIZES[family]:
            raise ValueError(f"--model-size {size!r} for {family}: choose one of {', '.join(SIZES[family])}")
        layers, hidden, heads, groups, ffn = SIZES[family][size]
        values.update(num_layers=layers, hidden_size=hidden, num_attention_heads=heads)
        if groups:
            values["num_query_groups"] = groups
        if ffn:
            values["ffn_hidden_size"] = ffn
    return values
