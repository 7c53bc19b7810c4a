"""`--padding-free`: fine-tune a Hugging Face encoder on packed rows of tokens instead of padded batches.

A padded batch of samples averaging 136 tokens, padded to ~250, spends ~45% of its work on padding. With
--padding-free the training collator (data/flatten.py `FlattenCollator`) concatenates each micro batch's samples
into one row (padded only up to a multiple of --pad-to-multiple-of: a few token budgets, one compiled shape and
CUDA graph each), and `apply_padding_free(model)` makes the model's forward take such a row:

- the model's own modules run it: its embeddings (positions restarting at every sample, token types per
  token), its encoder layers and its task head; only the attention function differs. It is registered with
  transformers' AttentionInterface under `padding_free_<original>` (the model's config then names it; the mask
  interface gets the original's mask function): called with `cu_seq_lens_q` it attends within each sample
  (CUDA fp16/bf16: the flash kernels on variable-length sequences with the layer's attention dropout,
  compat/flash_varlen.py; elsewhere SDPA with a block-diagonal mask), otherwise it is the original implementation
  with the original mask, so padded batches (evaluation) run as before.
- a small adapter per task takes the per-sample outputs from the row and computes the model's loss:
    sequence classification  the rows where samples start ([CLS]) -> the model's pooler, dropout and classifier;
                             cross entropy averaged over the samples, as BertForSequenceClassification does
    token classification     the classifier on every row of the packed tokens (logits [1, T, labels]); cross
                             entropy averaged over the labelled tokens (the filler is labelled -100)
  The model's `forward` is replaced in place (an instance attribute: parameter names, state dicts, DDP/FSDP2
  wrapping, torch.compile and save_pretrained are unchanged): a batch with `cu_seq_lens` goes to the adapter,
  any other batch to the original forward.

Supported: BERT-family models (`model_type` bert: BERT, MiniLM, ...) with the sdpa or eager attention, as
BertForSequenceClassification (single-label) or BertForTokenClassification, encoders only. Refused in words:
other families (RoBERTa offsets its positions, DistilBERT and others do not route attention through the
interface, decoders attend causally), other heads, regression and multi-label classification.
"""
from __future__ import annotations

import sys
from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F

from megatron_patch.data.flatten import is_packed

FAMILIES = ("bert",)
TASKS = {"BertForSequenceClassification": "sequence classification",
         "BertForTokenClassification": "token classification"}
ORIGINALS = ("sdpa", "eager")  # attention implementations the padded path keeps
PREFIX = "padding_free_"
FIX = "drop --padding-free"


def config_refusal(config, model_class: Optional[str] = None) -> Optional[str]:
    """Why --padding-free cannot run a model of this config (and class, when known), in one sentence; None if it can."""
    kind = getattr(config, "model_type", None)
    if kind not in FAMILIES:
        return (f"--padding-free runs BERT-family encoders (model_type {', '.join(FAMILIES)}), whose attention goes "
                f"through transformers' attention interface and whose positions start at 0 for every sample; this "
                f"model is {kind!r}: {FIX}")
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        return f"--padding-free packs bidirectional encoders; this {kind} model is configured as a decoder: {FIX}"
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in ORIGINALS and not impl.startswith(PREFIX):
        return (f"--padding-free replaces the attention of models that use {' or '.join(ORIGINALS)} attention; this "
                f"model uses {impl!r}: load it with attn_implementation='sdpa', or {FIX}")
    if model_class is not None and model_class not in TASKS:
        return (f"--padding-free has adapters for {', '.join(f'{c} ({t})' for c, t in TASKS.items())}; the model is "
                f"a {model_class}: {FIX}")
    if model_class == "BertForSequenceClassification":
        problem = getattr(config, "problem_type", None)
        if problem not in (None, "single_label_classification") or getattr(config, "num_labels", 2) < 2:
            return (f"--padding-free computes the single-label cross entropy of sequence classification; this model "
                    f"is set up for {problem or 'regression (one label)'}: {FIX}")
    return None


def refusal(model: torch.nn.Module) -> Optional[str]:
    """Why `model` cannot be trained padding-free, in one sentence; None if it can."""
    config = getattr(model, "config", None)
    if config is None:
        return (f"--padding-free runs Hugging Face models (BertForSequenceClassification, "
                f"BertForTokenClassification); got a {type(model).__name__}: {FIX}")
    problem = config_refusal(config, type(model).__name__)
    if problem is None and getattr(getattr(model, "base_model", None), "pooler", None) is None \
            and type(model).__name__ == "BertForSequenceClassification":
        problem = f"--padding-free: this {type(model).__name__} has no pooler: {FIX}"
    return problem


# ---- the attention function -----------------------------------------------------------------------------------
def _block_diagonal_attention(query, key, value, cu_seq_lens, scaling, dropout):
    """SDPA over the whole row with a mask that keeps each token's attention inside its own segment."""
    tokens = query.shape[2]
    positions = torch.arange(tokens, device=query.device, dtype=cu_seq_lens.dtype)
    segment = torch.searchsorted(cu_seq_lens[1:], positions, right=True)
    mask = segment[:, None] == segment[None, :]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2)


def _packed_attention(module, query, key, value, cu_seq_lens, max_len, scaling, dropout):
    """query/key/value [1, heads, T, head_dim] of one packed row -> [1, T, heads, head_dim], attention within segments."""
    if getattr(module, "is_causal", False):
        raise ValueError("--padding-free attends bidirectionally within each sample; this layer is causal")
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16):
        from megatron_patch.compat.flash_varlen import flash_varlen_attention

        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, heads, head_dim], contiguous
        return flash_varlen_attention(q, k, v, cu_seq_lens, max_len, dropout, scaling).unsqueeze(0)
    return _block_diagonal_attention(query, key, value, cu_seq_lens, scaling, dropout)


def _attention_function(original: str) -> Callable:
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        cu_seq_lens = kwargs.get("cu_seq_lens_q")
        if cu_seq_lens is not None:
            return _packed_attention(module, query, key, value, cu_seq_lens, kwargs["max_length_q"], scaling,
                                     dropout), None
        if original == "eager":  # the model family's own eager function, as its attention layer would pick
            padded = sys.modules[type(module).__module__].eager_attention_forward
        else:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

            padded = ALL_ATTENTION_FUNCTIONS[original]
        return padded(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)

    attention.__name__ = f"{PREFIX}{original}"
    return attention


def register_attention(original: str) -> str:
    """Register `padding_free_<original>` with transformers' attention and mask interfaces; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = f"{PREFIX}{original}"
    AttentionInterface.register(name, _attention_function(original))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
    return name


# ---- the task adapters ----------------------------------------------------------------------------------------
def _encode(model: torch.nn.Module, batch: Dict) -> torch.Tensor:
    """The encoder's last hidden states [1, T, hidden] of a packed row: the model's embeddings and layers."""
    base = model.base_model
    hidden = base.embeddings(input_ids=batch["input_ids"], token_type_ids=batch.get("token_type_ids"),
                             position_ids=batch["position_ids"])
    cu, max_len = batch["cu_seq_lens"], batch["max_seq_len"]
    return base.encoder(hidden, attention_mask=None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len,
                        max_length_k=max_len).last_hidden_state


def _single_label_loss(logits: torch.Tensor, labels: Optional[torch.Tensor], num_labels: int):
    if labels is None:
        return None
    if labels.is_floating_point():
        raise ValueError("--padding-free computes the single-label cross entropy; float labels (multi-label or "
                         "regression) are not supported: drop --padding-free")
    return F.cross_entropy(logits.reshape(-1, num_labels).float(), labels.reshape(-1))


def sequence_classification(model: torch.nn.Module, batch: Dict):
    from transformers.modeling_outputs import SequenceClassifierOutput

    hidden = _encode(model, batch)
    first = hidden[0].index_select(0, batch["sample_starts"])  # each sample's [CLS] row, [samples, hidden]
    pooled = model.base_model.pooler(first.unsqueeze(1))  # the pooler reads position 0 of each sample
    logits = model.classifier(model.dropout(pooled))
    return SequenceClassifierOutput(loss=_single_label_loss(logits, batch.get("labels"), model.num_labels),
                                    logits=logits)


def token_classification(model: torch.nn.Module, batch: Dict):
    from transformers.modeling_outputs import TokenClassifierOutput

    logits = model.classifier(model.dropout(_encode(model, batch)))
    return TokenClassifierOutput(loss=_single_label_loss(logits, batch.get("labels"), model.num_labels),
                                 logits=logits)


ADAPTERS = {"BertForSequenceClassification": sequence_classification,
            "BertForTokenClassification": token_classification}


def apply_padding_free(model: torch.nn.Module) -> str:
    """Make `model` (a plain Hugging Face model, before any wrapping) take packed rows as well as padded batches
    (module docstring); returns the log phrase. Raises ValueError with a sentence for a model it cannot run."""
    problem = refusal(model)
    if problem:
        raise ValueError(problem)
    kind = type(model).__name__
    adapter = ADAPTERS[kind]
    original = model.config._attn_implementation or "eager"
    if not original.startswith(PREFIX):
        model.set_attn_implementation(register_attention(original))
    padded_forward = getattr(model, "_padded_forward", model.forward)

    def forward(*args, **kwargs):
        if not args and is_packed(kwargs):
            return adapter(model, kwargs)
        return padded_forward(*args, **kwargs)

    model._padded_forward = padded_forward
    model.forward = forward
    return (f"padding-free: {kind} ({TASKS[kind]}) trains on packed rows (one per micro batch, positions restarting "
            f"per sample, attention within each sample: flash varlen kernels on a GPU in fp16/bf16, else SDPA "
            f"with a block-diagonal mask); padded batches (evaluation) run the {original} attention as before")
