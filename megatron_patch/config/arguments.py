"""Command-line flags (Megatron-LM / Rapidformer names) -> `Config`."""
from __future__ import annotations

import argparse
from typing import Callable, Dict, List, Optional

from .config import Config, ConfigError
from . import flag_parser, model_source
from .flag_parser import EntryParser
from .presets import preset


class _Parser(EntryParser):
    """argparse that raises ConfigError for a bad flag instead of printing usage and exiting: the entry point
    then reports it like any other configuration error (once, not once per torchrun worker)."""

    def error(self, message: str):
        raise ConfigError(f"{message} (--help lists every flag)")

    def refuse(self, message: str):  # a flag of another entry point: the sentence names the one that takes it
        raise ConfigError(message)


MODELS = {"gpt": "a GPT/Llama-family model", "bert": "a BERT model (masked LM + next-sentence prediction)"}


def build_parser(model: str = "gpt") -> argparse.ArgumentParser:
    """The parser of pretrain_megatron_gpt.py ("gpt") or pretrain_megatron_bert.py ("bert"), generated from the
    flag registry (config/flags.py); flags not given are left out of the namespace."""
    return flag_parser.build_parser(
        model, parser_class=_Parser,
        description=f"Pretrain {MODELS[model]} with megatron-core (TP/PP/DP, ZeRO-1, bf16/fp16).")


def parse_args(argv: Optional[List[str]] = None, model: str = "gpt",
               hf_architecture: Optional[Callable[[str], Dict]] = None) -> Config:
    """Flags -> Config: defaults, then the family/size preset, then the flags given. `model` is the entry
    point's kind: "gpt" (pretrain_megatron_gpt.py) or "bert" (pretrain_megatron_bert.py, always --model-family bert).

    `hf_architecture(DIR)` gives the architecture of --load-hf DIR (engine settings from its config.json); reading
    it takes the conversion's family tables, a floor above: megatron_patch.conversion.hf_source.parse_args passes it."""
    given = vars(build_parser(model).parse_args(argv))
    values = {}
    family = given.get("model_family")
    if model == "bert":
        if family not in (None, "bert"):
            raise ConfigError(f"--model-family {family}: pretrain_megatron_bert.py trains BERT; {family} trains with "
                              f"pretrain_megatron_gpt.py (pretrain_scripts/run_gpt.sh)")
        # As if given: a checkpoint of another family in --load is then refused, not silently trained as BERT.
        family = given["model_family"] = "bert"
        given.setdefault("tokenizer_type", "BertWordPieceLowerCase")  # Megatron-LM's pretrain_bert.py default
    else:
        if family == "bert":
            raise ConfigError("--model-family bert trains with pretrain_megatron_bert.py (pretrain_scripts/run_bert.sh), "
                              "not with this GPT entry point")
        if family is None and "model_size" in given:
            family = "gpt"
    if family is not None:
        try:
            values.update(preset(family, given.get("model_size")))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    values.update(given)
    if given.get("load_hf"):  # the architecture of the Hugging Face model (and its dropout, unless given)
        if hf_architecture is None:
            raise ConfigError(f"--load-hf {given['load_hf']}: this parser does not read a Hugging Face model's "
                              "config.json; parse with megatron_patch.conversion.hf_source.parse_args (the entry "
                              "points do)")
        model_source.merge(values, given, hf_architecture(given["load_hf"]), f"--load-hf {given['load_hf']}/config.json",
                           apply_other=True)
    elif given.get("load"):  # resuming: the architecture stored with the checkpoint
        stored = model_source.from_checkpoint(given["load"])
        if stored:
            model_source.merge(values, given, stored, f"the checkpoint in --load {given['load']}")
    if values.get("mock_data") and "vocab_size" not in given and values.get("model_vocab_size"):
        values["vocab_size"] = values["model_vocab_size"]  # random tokens over the model's whole vocabulary
    return Config.from_flat(values)
