"""Model families as megatron-core GPTModel / BertModel configs and layer specs."""
from .bert import build_bert_model
from .gpt import build_gpt_model, build_transformer_config, padded_vocab_size
from .stage import GPTModel

__all__ = ["GPTModel", "build_bert_model", "build_gpt_model", "build_transformer_config", "padded_vocab_size"]
