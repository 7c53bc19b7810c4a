"""The rules of BERT (see checks.py): the post-LN model's limits (any BERT: concern "model") and BERT pretraining's
data and objective (pretrain_megatron_bert.py only: concern "bert_pretraining", which runs when its entry point
names it; a BERT converted from Hugging Face or built by a test needs none of these)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from . import rule as probes
from .rule import rule

if TYPE_CHECKING:
    from .config import Config

BERT_TOKENIZERS = ("BertWordPieceLowerCase", "BertWordPieceCase")


@rule("model")
def bert_model(c: Config) -> Optional[str]:
    """Settings the post-LN BERT does not support."""
    if c.model_family != "bert":
        return None
    problems = []
    if c.normalization != "LayerNorm":
        problems.append(f"--normalization {c.normalization}: BERT uses LayerNorm")
    if c.swiglu:
        problems.append("--swiglu: BERT's MLP is dense -> gelu -> dense")
    if c.position_embedding_type != "learned_absolute":
        problems.append(f"--position-embedding-type {c.position_embedding_type}: BERT learns absolute positions")
    if c.num_experts:
        problems.append("--num-experts: the BERT model has no mixture-of-experts layers")
    if c.sequence_parallel:
        problems.append("--sequence-parallel: megatron-core's BertLMHead builds a torch LayerNorm, which refuses "
                        "sequence parallelism without apex; drop the flag")
    if probes.resolved_attention_backend(c.attention_backend) == "te":
        problems.append("--attention-backend te: Transformer Engine's layers fuse the LayerNorm before the linear "
                        "(pre-LN); use --attention-backend sdpa (or local)")
    if problems:
        return "BERT model: " + "; ".join(problems)


@rule("bert_pretraining")
def bert_pretraining_data(c: Config) -> Optional[str]:
    if c.mock_data:
        return ("BERT pretraining has no --mock-data (megatron-core has no mock BERT dataset): pass --data-path "
                "PREFIX_text_sentence made by tools/preprocess_data.py --split-sentences with a WordPiece tokenizer")
    if c.tokenizer_type not in BERT_TOKENIZERS:
        return (f"--tokenizer-type {c.tokenizer_type}: BERT pretraining masks with [MASK] and joins sentences with "
                f"[CLS] and [SEP]; use {' or '.join(BERT_TOKENIZERS)} with --vocab-file vocab.txt")


@rule("bert_pretraining")
def bert_objective(c: Config) -> Optional[str]:
    if not 0 < c.mask_prob < 1:
        return f"--mask-prob {c.mask_prob} must be between 0 and 1 (Megatron-LM and BERT use 0.15)"
    if not 0 <= c.short_seq_prob <= 1:
        return f"--short-seq-prob {c.short_seq_prob} must be between 0 and 1 (default 0.1)"


@rule("bert_pretraining")
def bert_pretraining_model(c: Config) -> Optional[str]:
    if c.num_experts:
        return "--num-experts: the BERT layers have dense MLPs only; mixture of experts is for GPT-family models"
    if c.seq_length < 8:
        return f"--seq-length {c.seq_length} is too short for BERT samples ([CLS] A [SEP] B [SEP] and masked tokens)"
    if c.num_layers_per_virtual_pipeline_stage is not None:
        return ("--num-layers-per-virtual-pipeline-stage: megatron-core's BertModel decides where the embedding is by "
                "the pipeline rank, not the virtual stage; use plain pipeline parallelism for BERT")
