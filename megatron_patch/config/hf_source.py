"""`--load-hf DIR`: the architecture (and dropout defaults) of the Hugging Face model in DIR, read from its
config.json through the conversion's mapping for the model's family.

This is one of the two imports against the layer order (tests/test_layering.py names it): the flags are parsed
(config) before anything else runs, and the mapping of a family's config.json to engine settings is part of the
conversion's family tables. Only parse_args imports this module; nothing in the conversion imports it back.
"""
from __future__ import annotations

from typing import Dict

from .errors import ConfigError


def from_hf(path: str) -> Dict:
    """Architecture (and dropout defaults) of the Hugging Face model in `path`."""
    from megatron_patch.conversion import tables
    from megatron_patch.conversion.hf_io import read_hf_config
    from megatron_patch.conversion.mapping import ConversionError

    try:
        config = read_hf_config(path)
        return tables.for_model_type(config.get("model_type", "")).engine_args(config)
    except (ConversionError, OSError, ValueError) as e:
        raise ConfigError(f"--load-hf {path}: {e}") from None
