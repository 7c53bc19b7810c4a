"""One typed configuration for pretraining, parsed from Megatron/Rapidformer-style flags.

`parse_args(argv)` -> `Config`; `Config.validate(world_size)` rejects impossible combinations before any
process group starts, each with a sentence naming the flags and the fix.
"""
from .arguments import build_parser, parse_args
from .config import Config, ConfigError

__all__ = ["Config", "ConfigError", "build_parser", "parse_args"]
