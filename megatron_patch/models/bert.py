"""BERT as the original and Hugging Face's `BertModel` compute it (post-LayerNorm), on megatron-core's BertModel.

    embeddings = dropout(LN(word + position + tokentype))
    each layer: x = LN(x + Attention(x)); x = LN(x + MLP(x))        (no final LayerNorm)
    MLM head:   LN(gelu(dense(x))) @ word_embeddings^T + bias       (tied unless --untie-embeddings-and-output-weights)
    NSP head:   binary_head(tanh(pooler_dense(x[CLS])))             (add_binary_head)

megatron-core 0.19.2's BertModel is Megatron-LM's pre-LN variant (no embedding LayerNorm, a final LayerNorm);
the three places where post-LN needs more than a layer spec are in megatron_patch/compat/post_layernorm.py.
Attention takes a key-padding mask ([b, 1, 1, s], as Hugging Face): no position attends to padding, and
padded positions compute what Hugging Face computes for them. Token types: always 2 embeddings (Hugging Face's
type_vocab_size), and `tokentype_ids=None` means all zeros, as in Hugging Face.
"""
from __future__ import annotations

import copy
from dataclasses import replace
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core.models.bert.bert_model import BertModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_patch.compat.post_layernorm import (drop_final_layernorm, norm_before_embedding_dropout,
                                                  post_layernorm_transformer_layer)
from megatron_patch.config.config import Config, ConfigError  # not the package: its parser reaches conversion

from .gpt import build_transformer_config, mask_vocab_padding, padded_vocab_size, resolve_attention_backend
from .norm import SequenceParallelNorm
from .sdpa_attention import SDPAttention

NUM_TOKENTYPES = 2  # Hugging Face BERT's type_vocab_size (segments A and B)


def check_bert_config(cfg: Config) -> None:
    """Refuse, in words, settings the post-LN BERT does not support (the rule bert_model of the configuration's
    table, config/checks_bert.py: validate() runs it too; a model built without validate() gets it here)."""
    from megatron_patch.config.checks_bert import bert_model

    refusal = bert_model(cfg.replace(model_family="bert"))
    if refusal:
        raise ConfigError(refusal)


def bert_layer_spec(cfg: Config) -> ModuleSpec:
    """The post-LN layer: megatron-core's local GPT layer (Column/RowParallelLinear attention and MLP, biases)
    with no input norms, a padding mask, SDPA (or megatron-core's unfused attention with --attention-backend
    local), and a LayerNorm after each residual add."""
    local = get_gpt_layer_local_spec(normalization="LayerNorm").submodules
    attention = copy.deepcopy(local.self_attention)
    attention.params = {**attention.params, "attn_mask_type": AttnMaskType.padding}
    if resolve_attention_backend(cfg) == "sdpa":
        attention.submodules.core_attention = SDPAttention
    submodules = replace(local, input_layernorm=IdentityOp, pre_mlp_layernorm=IdentityOp, self_attention=attention,
                         sharded_state_dict_keys_map={})  # no input norms, so nothing to rename to TE's names
    return ModuleSpec(module=post_layernorm_transformer_layer(), submodules=submodules,
                      params={"post_layernorm": SequenceParallelNorm})


class BertModelWithVocab(BertModel):
    """megatron-core's BertModel, post-LN (see the module docstring), whose MLM loss ignores the padding rows
    of the vocabulary (as GPTModelWithVocab: their logits are -inf before the cross entropy)."""

    def __init__(self, *args, true_vocab_size: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.true_vocab_size = true_vocab_size
        drop_final_layernorm(self.encoder)
        if self.pre_process:
            eps = self.config.layernorm_epsilon
            norm_before_embedding_dropout(self.embedding, SequenceParallelNorm(self.config, self.config.hidden_size, eps))

    def bert_extended_attention_mask(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """[b, s] (1 = token, 0 = padding) -> [b, 1, 1, s], True where attention is *not* allowed: a key-padding
        mask, as Hugging Face's. (megatron-core's [b, 1, s, s] outer product also masks every key of a padded
        query; what such a row yields depends on the attention kernel (zeros, NaN), and the hidden states of
        padded positions then differ from Hugging Face's.)"""
        return (attention_mask < 0.5).unsqueeze(1).unsqueeze(1)

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                tokentype_ids: Optional[torch.Tensor] = None, lm_labels: Optional[torch.Tensor] = None, *args, **kwargs):
        """megatron-core's BertModel.forward: [b, s] tokens, padding mask (None: no padding) and token types (None:
        all segment A). Returns (logits [b, s, padded vocab], NSP logits [b, 2] or None), or with `lm_labels`
        (per-token MLM loss [b, s], NSP logits); on a stage without the heads, the hidden states [s, b, h]."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if tokentype_ids is None and self.pre_process and self.embedding.tokentype_embeddings is not None:
            tokentype_ids = torch.zeros_like(input_ids)
        return super().forward(input_ids, attention_mask, tokentype_ids, lm_labels, *args, **kwargs)

    def compute_language_model_loss(self, labels, logits):
        return super().compute_language_model_loss(labels, mask_vocab_padding(logits, self.true_vocab_size))


def build_bert_model(cfg: Config, vocab_size: int, pre_process: bool = True, post_process: bool = True,
                     vp_stage: Optional[int] = None, add_binary_head: bool = True) -> BertModel:
    """One pipeline stage (or virtual stage `vp_stage`) of the post-LN BERT that `cfg` describes, on this
    rank's device: embedding (with its LayerNorm) on the first stage, the MLM head (and with
    `add_binary_head` the pooler and NSP head) on the last. `vocab_size`: the tokenizer's (real) vocabulary;
    the embedding is padded as for GPT (padded_vocab_size). Raises ConfigError for unsupported settings."""
    check_bert_config(cfg)
    model = BertModelWithVocab(
        config=build_transformer_config(cfg),
        num_tokentypes=NUM_TOKENTYPES,
        transformer_layer_spec=bert_layer_spec(cfg),
        vocab_size=padded_vocab_size(vocab_size, cfg),
        true_vocab_size=vocab_size,
        max_sequence_length=cfg.max_position_embeddings or cfg.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=not cfg.untie_embeddings_and_output_weights,
        position_embedding_type="learned_absolute",
        add_binary_head=add_binary_head,
        vp_stage=vp_stage,
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


def bert_pretraining_loss(lm_loss: torch.Tensor, loss_mask: torch.Tensor, binary_logits: Optional[torch.Tensor] = None,
                          is_random: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """BERT's pretraining loss as Megatron-LM's pretrain_bert.py combines it: the per-token MLM loss `lm_loss`
    [b, s] (the model's output with lm_labels) averaged over the masked positions (`loss_mask` 1), plus, with
    the NSP head, the cross entropy of `binary_logits` [b, 2] against `is_random` [b] (1: B is a random
    sentence, 0: B follows A, -1: ignored), averaged over the batch. This equals Hugging Face's
    BertForPreTraining loss for labels = token where loss_mask else -100 and next_sentence_label = is_random.
    Returns (loss, {"lm loss": ..., "sop loss": ...}) for this micro batch (not averaged across ranks)."""
    mask = loss_mask.float().reshape(-1)
    lm = torch.sum(lm_loss.float().reshape(-1) * mask) / mask.sum().clamp(min=1)
    if binary_logits is None:
        return lm, {"lm loss": lm.detach()}
    sop = F.cross_entropy(binary_logits.reshape(-1, 2).float(), is_random.reshape(-1).long(), ignore_index=-1)
    return lm + sop, {"lm loss": lm.detach(), "sop loss": sop.detach()}
