"""BERT as megatron-core's BertModel (TEMPORARY stand-in, pre-LayerNorm layers of megatron-core's local spec).

The model helper's post-LayerNorm version (like Hugging Face BERT) replaces this file; the signature of
`build_bert_model` is the one both agree on.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch
from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
from megatron.core.models.bert.bert_model import BertModel

from megatron_patch.config import Config

from .gpt import build_transformer_config, padded_vocab_size, resolve_attention_backend
from .sdpa_attention import SDPAttention


def build_bert_model(cfg: Config, vocab_size: int, pre_process: bool = True, post_process: bool = True,
                     vp_stage: Optional[int] = None, add_binary_head: bool = True) -> BertModel:
    """One pipeline stage (or virtual stage `vp_stage`) of a BERT with a masked-LM head and, with
    `add_binary_head`, the next-sentence head (and two token types)."""
    config = build_transformer_config(cfg)
    spec = copy.deepcopy(bert_layer_local_spec)
    if resolve_attention_backend(cfg) == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    model = BertModel(
        config=config,
        num_tokentypes=2 if add_binary_head else 0,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(vocab_size, cfg),
        max_sequence_length=cfg.max_position_embeddings or cfg.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not cfg.untie_embeddings_and_output_weights,
        position_embedding_type=cfg.position_embedding_type,
        add_binary_head=add_binary_head,
        vp_stage=vp_stage,
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model
