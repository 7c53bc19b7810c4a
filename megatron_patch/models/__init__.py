"""Model families as megatron-core GPTModel configs and layer specs."""
from .gpt import build_gpt_model, build_transformer_config, padded_vocab_size

__all__ = ["build_gpt_model", "build_transformer_config", "padded_vocab_size"]
