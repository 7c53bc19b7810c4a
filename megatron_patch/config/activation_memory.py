"""Activation memory of a training step on one rank, from the configuration alone (the planner's estimate; the
model state is exact, `memory_model.py`, this part is a model: checked against the GPU's measured peak).

Per layer and token, the tensors the backward pass keeps (Korthikanti et al., "Reducing Activation Recomputation
in Large Transformer Models", restated for this engine's layers: SDPA/flash attention keeps no s x s scores):
the inputs of the two norms and of the QKV and FC1 projections (whole, or 1/TP with sequence parallelism), the
QKV output and the rotated queries and keys, the attention output, and the MLP's tensors (1/TP; SwiGLU keeps
5 x ffn per token, measured); dropout masks when dropout is on; for an MoE layer the routed copies of the tokens (top-k of them) through
the experts. Full recompute keeps each layer's input only, plus one layer's tensors while it is recomputed.
A pipeline stage holds the micro batches in flight of the 1F1B (or interleaved) schedule; the last stage adds the
logits and their fp32 softmax unless the loss is fused with the output layer (--cross-entropy-fusion-impl linear).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

from .memory_model import chunk_layers, padded_vocab

SWIGLU_KEPT = 5  # elements per token and ffn unit a SwiGLU MLP keeps for its backward


@dataclass(frozen=True)
class ActivationBytes:
    """Activation bytes on one rank: kept for the backward pass, and the largest short-lived tensor on top."""
    kept: int
    transient: int

    def as_dict(self) -> Dict[str, int]:
        return {"activations": self.kept, "transient": self.transient}


def _layer_elements(cfg, moe: bool) -> float:
    """Elements kept per token by one layer on one rank (no recompute)."""
    tp = cfg.tensor_model_parallel_size
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    groups = cfg.num_query_groups or heads
    d = cfg.kv_channels or h // heads
    replicated = 4 * h / (tp if cfg.sequence_parallel else 1)  # norm inputs, QKV and FC1 inputs
    attention = ((heads * d + 2 * groups * d) + (heads * d + groups * d) + heads * d) / tp
    if cfg.qk_layernorm:
        attention += (heads * d + groups * d) / tp
    masks = 0.0
    if cfg.hidden_dropout > 0:  # two bool masks (after the projection and after FC2)
        masks = 2 * h / (tp if cfg.sequence_parallel else 1) / 2  # 1 byte each: half an element of 2 bytes
    # SwiGLU keeps 5 x ffn per token (FC1's 2 x ffn output, the activation's internals and FC2's input), as measured
    # on an H100 (benchmarks/bench_planner.py: 3 x ffn left 2.1 x ffn per token and layer unaccounted)
    act = SWIGLU_KEPT if cfg.swiglu else 2
    if moe:
        k, ffn, etp = cfg.moe_router_topk, cfg.expert_ffn_size, cfg.expert_tp_size
        mlp = k * (2 * h + act * ffn / etp)  # routed inputs and outputs, the experts' MLPs
        if cfg.moe_shared_expert_intermediate_size:
            mlp += act * cfg.moe_shared_expert_intermediate_size / tp
    else:
        mlp = act * (cfg.ffn_hidden_size or 4 * h) / tp
    return replicated + attention + mlp + masks


def _in_flight(cfg, pp_rank: int) -> float:
    """Micro batches whose activations a stage holds at once, in units of a whole stage's layers."""
    pp, m = cfg.pipeline_model_parallel_size, max(cfg.num_microbatches, 1)
    if pp == 1:
        return 1.0
    vpp = cfg.virtual_pipeline_model_parallel_size
    if not vpp:
        return float(min(m, pp - pp_rank))
    # interleaved: (pp - rank - 1) * 2 + (vpp - 1) * pp warm-up chunk forwards, plus the one in flight
    chunks = min(m * vpp, (pp - pp_rank - 1) * 2 + (vpp - 1) * pp + 1)
    return chunks / vpp


def activation_bytes(cfg, vocab_size: int, pp_rank: int = 0) -> ActivationBytes:
    """Activation bytes of pipeline stage `pp_rank` for the configured micro batch, sequence and recompute."""
    dtype = 2 if (cfg.bf16 or cfg.fp16) else 4
    tokens = cfg.micro_batch_size * cfg.seq_length
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    sp = tp if cfg.sequence_parallel else 1
    moe_layers = set(cfg.moe_layers())
    layers = [x for v in range(cfg.virtual_pipeline_model_parallel_size or 1) for x in chunk_layers(cfg, pp_rank, v)]
    per_layer = [_layer_elements(cfg, x in moe_layers) * tokens * dtype for x in layers]
    full = cfg.recompute_granularity == "full" or (cfg.checkpoint_activations and cfg.recompute_granularity is None)
    if full:
        stage = len(layers) * tokens * cfg.hidden_size / sp * dtype
        recomputing = max(per_layer, default=0)
    else:
        stage = sum(per_layer)
        recomputing = 0
        if cfg.recompute_granularity == "selective":  # the attention output is recomputed, not kept
            heads, d = cfg.num_attention_heads, cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
            stage -= len(layers) * tokens * heads * d / tp * dtype
    kept = stage * _in_flight(cfg, pp_rank)
    if pp_rank == 0:
        kept += tokens * cfg.hidden_size / sp * dtype * (1 if pp == 1 else _in_flight(cfg, pp_rank))
    transient = recomputing
    if pp_rank == pp - 1 and cfg.cross_entropy_fusion_impl != "linear":
        # the logits (model dtype) and the loss's fp32 softmax of the vocabulary's 1/TP
        transient = max(transient, tokens * padded_vocab(cfg, vocab_size) // tp * (dtype + 4))
    return ActivationBytes(int(kept), int(transient))
