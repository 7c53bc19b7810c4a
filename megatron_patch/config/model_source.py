"""Where the model's architecture comes from when it is not given by flags: a Hugging Face directory
(`--load-hf`: its config.json) or an engine checkpoint (`--load`: the configuration stored in its
checkpoint.json). The user then does not repeat shapes; a flag that contradicts the source is refused. Reading a
Hugging Face directory goes through the conversion's family tables, a floor above: the entry point's parser
(megatron_patch.conversion.hf_source.parse_args) reads it and hands the result to `merge`."""
from __future__ import annotations

from typing import Dict, Optional, Tuple

from .errors import ConfigError

# Fields that define the model's parameters (and so must match the weights that will be loaded).
ARCHITECTURE = ("model_family", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                "ffn_hidden_size", "kv_channels", "max_position_embeddings", "position_embedding_type", "rotary_base",
                "normalization", "norm_epsilon", "swiglu", "openai_gelu", "untie_embeddings_and_output_weights",
                "disable_bias_linear", "add_qkv_bias", "qk_layernorm", "use_rope_scaling", "rope_scaling_factor",
                "rope_scaling_low_freq_factor", "rope_scaling_high_freq_factor",
                "rope_scaling_original_max_position_embeddings", "multi_latent_attention", "q_lora_rank",
                "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type", "rotary_scaling_factor",
                "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                "model_vocab_size", "padded_vocab_size", "bert_binary_head",
                # mixture of experts: which layers have experts, how many, their width and routing
                "num_experts", "moe_ffn_hidden_size", "moe_layer_freq", "moe_router_topk", "moe_router_pre_softmax",
                "moe_router_topk_scaling_factor", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate")
# A LoRA checkpoint's adapters (a checkpoint without them starts LoRA from its weights)
LORA = ("lora_rank", "lora_alpha", "lora_target")
FLAG = {"untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
        "bert_binary_head": "--bert-no-binary-head"}


def newest_manifest(path: str) -> Optional[Tuple[int, Dict]]:
    """(iteration, checkpoint.json) of the checkpoint that loading `path` would resume, or None when there is
    none to read (no directory, no checkpoint, or a damaged one: loading reports that, with the directory named)."""
    import os

    from . import checkpoint_layout as directory  # torch-free: the on-disk layout only

    if not os.path.isdir(path):
        return None
    try:
        iteration, _ = directory.select_checkpoint(path)
        if iteration is None:
            return None
        return iteration, directory.read_manifest(directory.checkpoint_dir(path, iteration))
    except (directory.CheckpointError, OSError, ValueError):
        return None


def from_checkpoint(path: str) -> Optional[Dict]:
    """Architecture stored with the checkpoint `--load` resumes, or None when there is none to read."""
    found = newest_manifest(path)  # a missing --load is reported by validate()
    if found is None:
        return None
    manifest = found[1]
    stored = manifest.get("config", {})
    arch = {k: stored[k] for k in ARCHITECTURE if k in stored}
    if stored.get("lora_rank"):  # a LoRA checkpoint resumes with its adapters (a base one takes this run's)
        arch.update({k: stored[k] for k in LORA if k in stored})
    model = manifest.get("model", {})
    if "vocab_size" in model:  # the embedding's rows, before and after padding, as saved
        arch.update(model_vocab_size=model["vocab_size"], padded_vocab_size=model["padded_vocab_size"])
    return arch


def merge(values: Dict, given: Dict, source: Dict, what: str, apply_other: bool = False) -> None:
    """Put `source`'s architecture into `values`; a flag the user gave must agree with it."""
    for key, value in source.items():
        if key in given:
            if key in ARCHITECTURE + LORA and value is not None and given[key] != value:
                flag = FLAG.get(key, "--" + key.replace("_", "-"))
                if key == "bert_binary_head":  # a switch that turns a head off: say it in words, not True/False
                    raise ConfigError(f"{flag} contradicts {what}, which has the next-sentence head: drop the flag")
                raise ConfigError(f"{flag} {given[key]} contradicts {what}, which says {value}: drop the flag "
                                  f"(the architecture comes from {what})")
        elif key in ARCHITECTURE + LORA or apply_other:
            values[key] = value
