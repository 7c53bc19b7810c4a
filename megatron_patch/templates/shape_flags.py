"""The shape flags (--num-layers, --hidden-size, ...) against a Hugging Face model.

A Megatron model is built from these flags. A Hugging Face model gets its shape from its config: the
black-box `--task pretraining` applies the flags to the directory's config, but a model that a user script
(or a fine-tuning task) loads with `from_pretrained` never reads them. So that no flag is silently ignored,
`check_shape_flags` compares the flags given with the model's config and refuses a difference in one sentence.
"""
from __future__ import annotations

import argparse
from typing import Dict, Optional, Tuple

# rapidformer flag -> Hugging Face config attributes that hold it (the first one the config has is used)
SHAPE_FLAGS: Dict[str, Tuple[str, ...]] = {
    "num_layers": ("num_hidden_layers", "n_layer"),
    "hidden_size": ("hidden_size", "n_embd"),
    "num_attention_heads": ("num_attention_heads", "n_head"),
    "max_position_embeddings": ("max_position_embeddings", "n_positions"),
    "ffn_hidden_size": ("intermediate_size", "n_inner"),
}


def config_value(config, flag: str) -> Tuple[str, Optional[int]]:
    """(attribute, value) of a shape flag in a Hugging Face config; value None when the config has none.
    GPT-2's `n_inner` None means 4 x hidden size, as in transformers."""
    for name in SHAPE_FLAGS[flag]:
        if hasattr(config, name):
            value = getattr(config, name)
            if name == "n_inner" and value is None:
                value = 4 * config_value(config, "hidden_size")[1]
            return name, value
    return SHAPE_FLAGS[flag][0], None


def mismatches(args: argparse.Namespace, config) -> Dict[str, Tuple[str, Optional[int], int]]:
    """{flag: (config attribute, the config's value, the flag's value)} for every shape flag given that the
    config does not have (None when the config has no such setting)."""
    out = {}
    for flag in SHAPE_FLAGS:
        given = getattr(args, flag, None)
        if given is None:
            continue
        name, value = config_value(config, flag)
        if value != given:
            out[flag] = (name, value, given)
    return out


def check_shape_flags(args: argparse.Namespace, model, where: str) -> None:
    """Raise ConfigError when a shape flag disagrees with the config of `model` (a Hugging Face model built by
    `where`, e.g. model_optimizer_lr_scheduler_provider()). Models without a config are not checked: their
    script may read the flags itself."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return
    bad = mismatches(args, config)
    if not bad:
        return
    from megatron_patch.config import ConfigError

    flags = " ".join(f"--{f.replace('_', '-')} {given}" for f, (_, _, given) in bad.items())
    found = ", ".join(f"{name} {value if value is not None else '(none)'}" for name, value, _ in bad.values())
    raise ConfigError(f"{flags}: the model from {where} has {found} in its config; a Hugging Face model's shape "
                      "comes from its config, not from these flags. Drop the flags, or build the model from them "
                      "(e.g. BertConfig(num_hidden_layers=args.num_layers, ...) and from_config)")
