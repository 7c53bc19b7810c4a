"""One conversion table per model family. Adding a family: a module with TABLE, engine_args(config.json)
and hf_config(engine config, vocab, end-of-document id), registered below under its Hugging Face model_type(s);
optionally HF_PREFIX (a name prefix that bare base-model checkpoints omit) and export_config(config.json, engine
config) (config.json of an export, from the original's)."""
from __future__ import annotations

from types import ModuleType
from typing import Dict

from ..mapping import ConversionError
from . import bert, gpt2, llama, mixtral, qwen2_moe

BY_MODEL_TYPE: Dict[str, ModuleType] = {"gpt2": gpt2, "llama": llama, "qwen2": llama, "mistral": llama,
                                        "mixtral": mixtral, "qwen2_moe": qwen2_moe, "bert": bert}
ENGINE_FAMILY = {"gpt2": "gpt", "gpt": "gpt", "llama": "llama", "qwen2": "qwen2", "mistral": "mistral",
                 "mixtral": "mixtral", "qwen2_moe": "qwen2_moe", "bert": "bert"}


def for_model_type(model_type: str) -> ModuleType:
    if model_type not in BY_MODEL_TYPE:
        raise ConversionError(f"config.json model_type {model_type!r}: conversion supports "
                              f"{', '.join(sorted(BY_MODEL_TYPE))}")
    return BY_MODEL_TYPE[model_type]


def for_engine(cfg) -> ModuleType:
    """The table of an engine model: by --model-family, else by its architecture (SwiGLU + RMSNorm + RoPE;
    with experts: a shared expert makes it Qwen2-MoE, none Mixtral)."""
    g = cfg.get if isinstance(cfg, dict) else lambda k: getattr(cfg, k)
    family = g("model_family")
    if family == "bert":
        return bert
    if family in ("gpt", "gpt2"):
        return gpt2
    if family in ("mixtral", "qwen2_moe"):
        return BY_MODEL_TYPE[family]
    if g("num_experts") and g("swiglu") and g("normalization") == "RMSNorm":
        return qwen2_moe if g("moe_shared_expert_intermediate_size") else mixtral
    if family in ("llama", "qwen2", "mistral"):
        return llama
    return llama if g("swiglu") and g("normalization") == "RMSNorm" else gpt2
