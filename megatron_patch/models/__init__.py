"""Model families as megatron-core GPTModel configs and layer specs."""
from .gpt import build_gpt_model, build_transformer_config, padded_vocab_size
from .stage import GPTModel

__all__ = ["GPTModel", "build_gpt_model", "build_transformer_config", "padded_vocab_size"]
