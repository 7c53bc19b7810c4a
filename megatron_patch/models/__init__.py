"""Model families as megatron-core GPTModel / BertModel configs and layer specs, and model building (build.py):
this rank's chunks, their initialisation and model switches, their training wrappers."""
from .bert import build_bert_model
from .build import build_model_chunks, model_info, model_vocab_size, wrap_model
from .gpt import build_gpt_model, build_transformer_config, padded_vocab_size
from .stage import GPTModel

__all__ = ["GPTModel", "build_bert_model", "build_gpt_model", "build_model_chunks", "build_transformer_config",
           "model_info", "model_vocab_size", "padded_vocab_size", "wrap_model"]
