"""`--load-hf DIR` for the entry points: the architecture a Hugging Face directory gives the flags (parse time) and
the loader of its weights (build time), both through the conversion's family tables.

The configuration and the training loop, on the floors below, know nothing of the conversion: the entry point
(megatron_patch.cli.pretrain) parses with `parse_args` here, which hands config's parser `architecture` as the
reader of --load-hf's config.json, and gives the Trainer `weights_for(cfg)` as its `load_weights`. Light on
purpose (the entry point imports it before torch): torch and the tables are imported when used.
"""
from __future__ import annotations

from typing import Dict, List, Optional

from megatron_patch.config import Config, ConfigError
from megatron_patch.config.arguments import parse_args as parse_flags


def architecture(path: str) -> Dict:
    """Architecture (and dropout defaults) of the Hugging Face model in `path`, as engine settings."""
    from . import tables
    from .hf_io import read_hf_config
    from .mapping import ConversionError

    try:
        config = read_hf_config(path)
        return tables.for_model_type(config.get("model_type", "")).engine_args(config)
    except (ConversionError, OSError, ValueError) as e:
        raise ConfigError(f"--load-hf {path}: {e}") from None


def parse_args(argv: Optional[List[str]] = None, model: str = "gpt") -> Config:
    """The flags of pretrain_megatron_gpt.py ("gpt") or pretrain_megatron_bert.py ("bert") -> Config, with
    --load-hf DIR's architecture read from DIR/config.json (megatron_patch.config.parse_args, which cannot read it)."""
    return parse_flags(argv, model=model, hf_architecture=architecture)


class HFWeights:
    """The weights of the Hugging Face directory `path`, loaded into this rank's bare model chunks through the
    family's table (a models.build.WeightLoader); `hf_config` (its config.json) goes into the checkpoint's manifest."""

    def __init__(self, path: str) -> None:
        from .hf_io import read_hf_config

        self.path = path
        self.hf_config: Optional[Dict] = read_hf_config(path)

    def __call__(self, chunks: List, cfg: Config) -> None:
        from megatron_patch.parallel import print_rank_0

        from .load_hf import describe_load, load_hf_weights

        loaded = load_hf_weights(chunks, cfg, self.path)
        for line in describe_load(loaded, f"--load-hf {self.path}"):
            print_rank_0(line)


def weights_for(cfg: Config) -> Optional[HFWeights]:
    """The loader of --load-hf's weights, or None when the run does not start from a Hugging Face model."""
    return HFWeights(cfg.load_hf) if cfg.load_hf else None


def build_model(cfg: Config, vocab_size: int, for_training: bool = True) -> List:
    """models.build.build_model with --load-hf's weights loaded (when cfg.load_hf is set): this rank's model
    chunks, wrapped for training, or bare with `for_training=False`."""
    from megatron_patch.models.build import build_model as build

    return build(cfg, vocab_size, for_training=for_training, load_weights=weights_for(cfg))
