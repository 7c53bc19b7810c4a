"""The model families of the conversion, registered by name (`FAMILIES`, conversion/family.py).

Adding a family: a module here that builds `FAMILY = Family(table, model_types, engine_families, engine_args,
hf_config, ...)` (its conversion table, its config.json <-> engine Config mapping, its optional parts), and
one line below that registers it."""
from __future__ import annotations

from ..family import Family, Registry
from . import bert, deepseek_v2, gpt2, llama, mixtral, qwen2_moe

FAMILIES = Registry()
for _module in (gpt2, llama, mixtral, qwen2_moe, deepseek_v2, bert):
    FAMILIES.register(_module.FAMILY)


def family(name: str) -> Family:
    """The family registered as `name`; ConversionError listing the known ones otherwise."""
    return FAMILIES.get(name)


def for_model_type(model_type: str) -> Family:
    """The family of a Hugging Face config.json's model_type; ConversionError listing the supported ones."""
    return FAMILIES.for_model_type(model_type)


def for_engine(cfg) -> Family:
    """The family of an engine model (a Config or its dict): by --model-family, else by its architecture
    (SwiGLU + RMSNorm + RoPE is a Llama; with experts: a shared expert or q/k norms make it Qwen2/3-MoE, neither
    Mixtral)."""
    g = cfg.get if isinstance(cfg, dict) else lambda k: getattr(cfg, k)
    named = FAMILIES.for_engine_family(g("model_family"))
    if named is not None and named is not llama.FAMILY:  # a llama-named model with experts is one of the MoE families
        return named
    llama_like = g("swiglu") and g("normalization") == "RMSNorm"
    if g("num_experts") and llama_like:
        qwen = g("moe_shared_expert_intermediate_size") or g("qk_layernorm")
        return qwen2_moe.FAMILY if qwen else mixtral.FAMILY
    return named or (llama.FAMILY if llama_like else gpt2.FAMILY)
