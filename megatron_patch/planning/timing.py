"""Predicted step time of a layout: compute from measured per-layer speed on one GPU (layer_speed.py), scaled by
the layer's shape; communication from bandwidth; the pipeline bubble from the schedule.

- compute: a layer's forward + backward FLOPs per token on one rank (its GEMMs, 1/TP of them, and causal
  attention), divided by the speed one GPU reached on a layer of that size (interpolated in log FLOPs), times the
  tokens of a micro batch, plus the layer's fixed cost per micro batch (layer_speed.py); full recompute adds a
  forward, selective recompute the core attention's forward. The last stage adds the output layer.
- tensor parallelism: per layer and micro batch four all-reduces (or all-gather + reduce-scatter pairs with
  sequence parallelism, the same bytes) of the activations, six with full recompute; not overlapped.
- pipeline: (PP - 1) / VPP micro batches of bubble, and the activations' point-to-point transfers.
- data parallelism: the gradient all-reduce (ZeRO-0) or reduce-scatter plus parameter all-gather (ZeRO-1/2)
  once per step, not overlapped (the engine reduces after the last micro batch).
- experts: per MoE layer and micro batch two all-to-alls forward and two backward of the routed tokens.
- the optimizer step: memory-bound over this rank's share of the state.
Bandwidth: NVLink within a node, the NIC between nodes (a group spans nodes when its ranks do).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

from megatron_patch.config.memory_model import chunk_layers, padded_vocab, rank_state_bytes

from .hardware import Gpu
from .layer_speed import achieved_tflops, fixed_seconds


def layer_flops_per_token(cfg, moe: bool) -> float:
    """Forward FLOPs per token of one layer on one tensor-parallel rank (GEMMs and causal attention)."""
    tp, h, heads = cfg.tensor_model_parallel_size, cfg.hidden_size, cfg.num_attention_heads
    groups, d = cfg.num_query_groups or heads, cfg.kv_channels or h // heads
    attn = (2 * heads * d + 2 * groups * d) * h / tp
    mats = 3 if cfg.swiglu else 2
    if moe:
        mlp = cfg.moe_router_topk * mats * h * cfg.expert_ffn_size / cfg.expert_tp_size + cfg.num_experts * h
        if cfg.moe_shared_expert_intermediate_size:
            mlp += mats * h * cfg.moe_shared_expert_intermediate_size / tp
    else:
        mlp = mats * h * (cfg.ffn_hidden_size or 4 * h) / tp
    causal_attention = 2 * cfg.seq_length * heads * d / tp  # QK^T and AV over half the positions on average
    return 2 * (attn + mlp) + causal_attention


def model_flops_per_token(cfg, vocab_size: int) -> float:
    """The engine's MFU convention (and Megatron-LM's): 6 x active parameters + 12 x layers x hidden x sequence."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    groups, d = cfg.num_query_groups or heads, cfg.kv_channels or h // heads
    mats = 3 if cfg.swiglu else 2
    attn = (2 * heads * d + 2 * groups * d) * h
    dense = mats * h * (cfg.ffn_hidden_size or 4 * h)
    moe = cfg.moe_router_topk * mats * h * cfg.expert_ffn_size + (mats * h * (cfg.moe_shared_expert_intermediate_size or 0))
    moe_layers = set(cfg.moe_layers())
    active = sum(attn + (moe if i in moe_layers else dense) for i in range(cfg.num_layers))
    active += padded_vocab(cfg, vocab_size) * h
    return 6 * active + 12 * cfg.num_layers * h * cfg.seq_length


@dataclass(frozen=True)
class StepTime:
    compute: float
    bubble: float
    tp_comm: float
    pp_comm: float
    dp_comm: float
    ep_comm: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.compute + self.bubble + self.tp_comm + self.pp_comm + self.dp_comm + self.ep_comm + self.optimizer

    def as_dict(self) -> Dict[str, float]:
        return {k: getattr(self, k) for k in ("compute", "bubble", "tp_comm", "pp_comm", "dp_comm", "ep_comm",
                                              "optimizer", "total")}


def _bandwidth(g: Gpu, span: int, intra: float, inter: float) -> float:
    """Bytes/s of a group whose ranks span `span` consecutive ranks."""
    return (intra if span <= g.gpus_per_node else inter) * 1e9


def _ring(size: int, nbytes: float, bw: float, all_reduce: bool) -> float:
    if size <= 1:
        return 0.0
    return (2 if all_reduce else 1) * (size - 1) / size * nbytes / bw


def step_time(cfg, vocab_size: int, world_size: int, g: Gpu, intra_gbps: float = None, inter_gbps: float = None) -> StepTime:
    """Predicted seconds of one training step (the slowest pipeline stage sets the pace)."""
    intra, inter = intra_gbps or g.intra_node_gbps, inter_gbps or g.inter_node_gbps
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    dp = world_size // (tp * pp)
    vpp = cfg.virtual_pipeline_model_parallel_size or 1
    m = cfg.global_batch_size // (cfg.micro_batch_size * dp)
    tokens = cfg.micro_batch_size * cfg.seq_length
    act_bytes = tokens * cfg.hidden_size * (2 if (cfg.bf16 or cfg.fp16) else 4)
    full = cfg.recompute_granularity == "full"
    passes = 4 if full else 3
    moe_layers = set(cfg.moe_layers())
    bw_tp = _bandwidth(g, tp, intra, inter)
    ep, etp = cfg.expert_model_parallel_size, cfg.expert_tp_size
    bw_ep = _bandwidth(g, ep * etp, intra, inter)
    stage_times = []
    for p in range(pp):
        layers = [x for v in range(vpp) for x in chunk_layers(cfg, p, v)]
        compute = tp_comm = ep_comm = 0.0
        heads, d = cfg.num_attention_heads, cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
        # selective recompute runs the core attention's forward again: causal QK^T and AV of 1/TP of the heads
        again = 2 * cfg.seq_length * heads * d / tp if cfg.recompute_granularity == "selective" else 0.0
        for x in layers:
            f = layer_flops_per_token(cfg, x in moe_layers)
            # the fixed part per pass: a forward is about a third of the kernels of forward + backward
            compute += (passes * f + again) * tokens / (achieved_tflops(g, f) * 1e12) + passes / 3 * fixed_seconds(g, f)
            tp_comm += (6 if full else 4) * _ring(tp, act_bytes, bw_tp, all_reduce=True)
            if x in moe_layers and ep > 1:
                routed = act_bytes * cfg.moe_router_topk * (ep - 1) / ep
                ep_comm += (6 if full else 4) * routed / bw_ep
        if p == pp - 1:
            f = 2 * cfg.hidden_size * padded_vocab(cfg, vocab_size) / tp
            compute += 3 * f * tokens / (achieved_tflops(g, f) * 1e12)
        stage_times.append((compute, tp_comm, ep_comm))
    compute, tp_comm, ep_comm = max(stage_times, key=lambda t: sum(t))
    per_micro = compute + tp_comm + ep_comm
    bubble = (pp - 1) / vpp * per_micro if pp > 1 else 0.0
    bw_pp = _bandwidth(g, world_size, intra, inter) if pp > 1 and world_size // pp >= g.gpus_per_node else intra * 1e9
    sp = tp if cfg.sequence_parallel else 1
    pp_comm = 2 * (m + pp - 1) * act_bytes / sp / bw_pp if pp > 1 else 0.0
    # data parallelism: the rank's buffers, once per step
    state = rank_state_bytes(cfg, vocab_size, world_size, 0)
    grad_bytes = state.grads if cfg.zero_stage != 2 else state.grads * dp
    param_bytes = (state.weights if cfg.zero_stage else 0)
    bw_dp = _bandwidth(g, tp * dp, intra, inter)
    if cfg.zero_stage == 0:
        dp_comm = _ring(dp, grad_bytes, bw_dp, all_reduce=True)
    else:
        dp_comm = _ring(dp, grad_bytes, bw_dp, all_reduce=False) + _ring(dp, param_bytes, bw_dp, all_reduce=False)
    # the optimizer reads and writes its state and the weights once: memory-bound
    optimizer = 2 * (state.optimizer + state.weights + state.grads / max(dp if cfg.zero_stage else 1, 1)) / (g.hbm_gbps * 1e9)
    return StepTime(compute=m * compute, bubble=bubble, tp_comm=m * tp_comm, pp_comm=pp_comm, dp_comm=dp_comm,
                    ep_comm=m * ep_comm, optimizer=optimizer)


def mfu(cfg, vocab_size: int, world_size: int, g: Gpu, seconds: float) -> float:
    tokens = cfg.global_batch_size * cfg.seq_length
    return tokens * model_flops_per_token(cfg, vocab_size) / seconds / world_size / (g.bf16_tflops * 1e12)
