"""The shape flags (--num-layers, --hidden-size, ...) and the setting flags (--hidden-dropout,
--attention-dropout, --init-method-std) against a Hugging Face model.

A Megatron model is built from these flags. A Hugging Face model gets its shape and settings from its config:
the black-box `--task pretraining` applies the shape flags to the directory's config, and the black-box tasks
(fine-tuning and pretraining) put the setting flags in the config of the model they load (`config_settings`),
but a model that a user script loads with `from_pretrained` never reads them. So that no flag is silently
ignored, `check_shape_flags` compares the flags given with the model's config and refuses a difference in one
sentence.
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


# rapidformer flag -> the Hugging Face config attributes that hold the same setting (all those a config has are
# set): Megatron's hidden dropout also drops the embeddings' output, as GPT-2's embd_pdrop does
SETTING_FLAGS: Dict[str, Tuple[str, ...]] = {
    "hidden_dropout": ("hidden_dropout_prob", "resid_pdrop", "embd_pdrop", "dropout", "dropout_rate",
                       "hidden_dropout"),
    "attention_dropout": ("attention_probs_dropout_prob", "attn_pdrop", "attention_dropout"),
    "init_method_std": ("initializer_range", "init_std"),  # the std of the normal init of new weights
}


def _settings_given(args: argparse.Namespace, config):
    """(flag, the config attributes that may hold it, the flag's value, those the config holds as numbers) for each
    setting flag given."""
    for flag, names in SETTING_FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None:
            yield flag, names, value, [n for n in names if isinstance(getattr(config, n, None), (int, float))]


def config_settings(args: argparse.Namespace, config) -> Dict[str, float]:
    """{config attribute: value} for the setting flags given (every attribute of the config that holds the
    setting). Raises ConfigError naming the flag when the config has no such setting (e.g. --hidden-dropout for
    a Llama config, which has attention dropout only): the flag could not act."""
    out = {}
    for flag, names, value, present in _settings_given(args, config):
        if not present:
            from megatron_patch.config import ConfigError

            raise ConfigError(f"--{flag.replace('_', '-')} {value}: the {config.model_type} config has no such "
                             f"setting (looked for {', '.join(names)}); drop the flag")
        out.update(dict.fromkeys(present, value))
    return out


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


def setting_mismatches(args: argparse.Namespace, config) -> Dict[str, Tuple[str, Optional[float], float]]:
    """{flag: (config attribute, the config's value, the flag's value)} for the setting flags given that the
    config does not hold (None when the config has no such setting)."""
    out = {}
    for flag, names, given, present in _settings_given(args, config):
        wrong = [n for n in present if abs(getattr(config, n) - given) > 1e-12]
        if not present or wrong:
            name = wrong[0] if wrong else names[0]
            out[flag] = (name, getattr(config, name) if wrong else None, given)
    return out


def _describe(bad: Dict[str, Tuple]) -> Tuple[str, str]:
    flags = " ".join(f"--{f.replace('_', '-')} {given}" for f, (_, _, given) in bad.items())
    found = ", ".join(f"{name} {value if value is not None else '(none)'}" for name, value, _ in bad.values())
    return flags, found


def check_shape_flags(args: argparse.Namespace, model, where: str) -> None:
    """Raise ConfigError when a shape or setting flag disagrees with the config of `model` (a Hugging Face model
    built by `where`, e.g. model_optimizer_lr_scheduler_provider()). Models without a config are not checked:
    their script may read the flags itself."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return
    from megatron_patch.config import ConfigError

    bad = mismatches(args, config)
    if bad:
        flags, found = _describe(bad)
        raise ConfigError(f"{flags}: the model from {where} has {found} in its config; a Hugging Face model's shape "
                          "comes from its config, not from these flags. Drop the flags, or build the model from them "
                          "(e.g. BertConfig(num_hidden_layers=args.num_layers, ...) and from_config)")
    bad = setting_mismatches(args, config)
    if bad:
        flags, found = _describe(bad)
        raise ConfigError(f"{flags}: the model from {where} has {found} in its config; a Hugging Face model's "
                          "dropout and init come from its config, not from these flags. Drop the flags, or build "
                          "the model with them (e.g. from_pretrained(path, hidden_dropout_prob=args.hidden_dropout, "
                          "attention_probs_dropout_prob=args.attention_dropout, initializer_range="
                          "args.init_method_std))")
