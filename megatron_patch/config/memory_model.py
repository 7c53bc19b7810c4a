"""The bytes of model state every rank of a run holds (weights, gradient buffers, optimizer state), computed from
the configuration alone: no process group, no tensor.

It follows megatron-core 0.19.2's own arithmetic, rule by rule, so that it equals what the engine measures
(`training/memory.py`, logged per rank at the first iteration); a test holds the two equal for ten layouts:

- the parameters of a model chunk, in the order of `named_parameters()`: embedding (first stage), the chunk's
  layers, final norm and output layer (last stage; a tied output layer is a copy of the embedding there when
  PP > 1), each sharded by the tensor-parallel rules of its layer (column / row parallel, replicated norms);
  experts split over EP (whole experts) and expert-TP;
- megatron-core DDP's contiguous buffers, one per (dtype, dense/expert) group: the parameters in reverse order,
  and with the distributed optimizer (ZeRO-1) each parameter's start padded to 64 elements, the shared embedding
  in a bucket of its own, each bucket's end padded to lcm(DP, 128) (`param_layout.pad_param_start/pad_bucket_end`);
  the gradient buffer holds every element in fp32 (bf16 with --grad-reduce-in-bf16), the parameter buffer
  (ZeRO-1 only) in the parameters' dtype;
- the optimizer: Adam's two moments (and the fp32 main weights of a bf16/fp16 model) for every parameter
  (ZeRO-0) or for the elements of this rank's 1/DP of each bucket (ZeRO-1);
- ZeRO-2 (Megatron-FSDP, optim_grads): see `_fsdp_bytes`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Dict, List, Tuple

# megatron-core's rules (optimizer/param_layout.py), restated: the planner must not import megatron-core (it runs
# before any, and a test compares these with the engine's measurements)
PARAM_START_ALIGN = 64
BUCKET_END_ALIGN = 128


@dataclass(frozen=True)
class Param:
    """One parameter tensor on one rank: its name within the chunk, its element count there."""
    name: str
    numel: int
    expert: bool = False  # in the expert buffer (reduced over the expert data-parallel group)
    shared_embedding: bool = False  # the tied embedding/output copy of a pipeline end: a bucket of its own
    row: int = 1  # elements per row (shape[1:]): Megatron-FSDP aligns to it


@dataclass(frozen=True)
class StateBytes:
    """Bytes of model state on one rank."""
    weights: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer

    def as_dict(self) -> Dict[str, int]:
        return {"weights": self.weights, "grads": self.grads, "optimizer": self.optimizer}


class NotModelled(ValueError):
    """The memory model does not cover this configuration (said in words)."""


# ------------------------------------------------------------------------------------------ the parameters
def padded_vocab(cfg, vocab_size: int) -> int:
    """The engine's padding rule (models/gpt.py padded_vocab_size calls it): a multiple of
    lcm(--make-vocab-size-divisible-by, TP), or the checkpoint's padded size when one is being loaded."""
    if cfg.padded_vocab_size is not None:
        return cfg.padded_vocab_size
    multiple = math.lcm(cfg.make_vocab_size_divisible_by, cfg.tensor_model_parallel_size)
    return -(-vocab_size // multiple) * multiple


def _check_modelled(cfg) -> None:
    if cfg.model_family == "bert":
        raise NotModelled("the memory model covers GPT-style decoders (gpt, llama, qwen, mistral, mixtral, ...), "
                          "not BERT")
    if cfg.multi_latent_attention:
        raise NotModelled("the memory model does not cover multi-latent attention (DeepSeek) yet")


def _norm(prefix: str, size: int, cfg) -> List[Param]:
    out = [Param(f"{prefix}.weight", size)]
    if cfg.normalization == "LayerNorm":
        out.append(Param(f"{prefix}.bias", size))
    return out


def _linear(prefix: str, out_features: int, in_features: int, bias: bool, bias_size: int,
            expert: bool = False) -> List[Param]:
    out = [Param(f"{prefix}.weight", out_features * in_features, expert, row=in_features)]
    if bias:
        out.append(Param(f"{prefix}.bias", bias_size, expert))
    return out


def _attention(cfg, tp: int) -> List[Param]:
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    groups = cfg.num_query_groups or heads
    d = cfg.kv_channels or h // heads
    bias = not cfg.disable_bias_linear
    qkv = (heads * d + 2 * groups * d) // tp
    out = _linear("self_attention.linear_proj", h, heads * d // tp, bias, h)
    out += _linear("self_attention.linear_qkv", qkv, h, bias or cfg.add_qkv_bias, qkv)
    if cfg.qk_layernorm:
        out += _norm("self_attention.q_layernorm", d, cfg) + _norm("self_attention.k_layernorm", d, cfg)
    return out


def _mlp(prefix: str, cfg, ffn: int, tp: int, expert: bool = False) -> List[Param]:
    h, bias = cfg.hidden_size, not cfg.disable_bias_linear
    fc1 = (2 if cfg.swiglu else 1) * ffn // tp
    return (_linear(f"{prefix}.linear_fc1", fc1, h, bias, fc1, expert)
            + _linear(f"{prefix}.linear_fc2", h, ffn // tp, bias, h, expert))


def _moe(cfg, tp: int) -> List[Param]:
    ep, etp = cfg.expert_model_parallel_size, cfg.expert_tp_size
    out = [Param("mlp.router.weight", cfg.num_experts * cfg.hidden_size, row=cfg.hidden_size)]
    for i in range(cfg.num_experts // ep):
        out += _mlp(f"mlp.experts.local_experts.{i}", cfg, cfg.expert_ffn_size, etp, expert=True)
    if cfg.moe_shared_expert_intermediate_size:
        out += _mlp("mlp.shared_experts", cfg, cfg.moe_shared_expert_intermediate_size, tp)
        if cfg.moe_shared_expert_gate:
            out.append(Param("mlp.shared_experts.gate_weight", cfg.hidden_size, row=cfg.hidden_size))
    return out


def layer_params(cfg, layer: int, tp: int) -> List[Param]:
    """The parameters of global layer `layer` (from 0) on one tensor-parallel rank, named within the layer."""
    h = cfg.hidden_size
    out = _norm("input_layernorm", h, cfg) + _attention(cfg, tp) + _norm("pre_mlp_layernorm", h, cfg)
    if layer in set(cfg.moe_layers()):
        return out + _moe(cfg, tp)
    return out + _mlp("mlp", cfg, cfg.ffn_hidden_size or 4 * h, tp)


def chunk_layers(cfg, pp_rank: int, vpp_rank: int = 0) -> List[int]:
    """Global layer numbers of a model chunk: megatron-core's even split, interleaved with virtual stages."""
    pp, per_stage = cfg.pipeline_model_parallel_size, cfg.num_layers // cfg.pipeline_model_parallel_size
    per_chunk = cfg.num_layers_per_virtual_pipeline_stage
    if per_chunk is None:
        return list(range(pp_rank * per_stage, (pp_rank + 1) * per_stage))
    start = vpp_rank * pp * per_chunk + pp_rank * per_chunk
    return list(range(start, start + per_chunk))


def chunk_params(cfg, vocab_size: int, pp_rank: int = 0, vpp_rank: int = 0) -> List[Param]:
    """The parameters of one model chunk on one rank, in `named_parameters()` order (names without wrappers)."""
    _check_modelled(cfg)
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    vpp = cfg.virtual_pipeline_model_parallel_size or 1
    first = pp_rank == 0 and vpp_rank == 0
    last = pp_rank == pp - 1 and vpp_rank == vpp - 1
    h, vocab = cfg.hidden_size, padded_vocab(cfg, vocab_size) // tp
    tied = not cfg.untie_embeddings_and_output_weights
    out: List[Param] = []
    if first:
        out.append(Param("embedding.word_embeddings.weight", vocab * h, shared_embedding=tied and not last, row=h))
        if cfg.position_embedding_type == "learned_absolute":
            out.append(Param("embedding.position_embeddings.weight", (cfg.max_position_embeddings or cfg.seq_length) * h,
                             row=h))
    for i, layer in enumerate(chunk_layers(cfg, pp_rank, vpp_rank)):
        out += [replace(p, name=f"decoder.layers.{i}.{p.name}") for p in layer_params(cfg, layer, tp)]
    if last:
        out += _norm("decoder.final_layernorm", h, cfg)
        if not tied or not first:
            out.append(Param("output_layer.weight", vocab * h, shared_embedding=tied, row=h))
    return out


# ------------------------------------------------------------------------------------------ the buffers
def _pad(value: int, divisor: int) -> int:
    return -(-value // divisor) * divisor


def buffer_layout(params: List[Param], dp: int, distributed_optimizer: bool) -> Tuple[List[Tuple[int, int]],
                                                                                        List[Tuple[int, int]]]:
    """(each parameter's (start, end) in the buffer, in `params` order; the buckets' (start, end)), as megatron-core
    lays them out: parameters in reverse order, one bucket (no overlapped reduction), and with the distributed
    optimizer aligned starts, the shared embedding alone, bucket ends padded for DP."""
    spans: Dict[int, Tuple[int, int]] = {}
    buckets: List[Tuple[int, int]] = []
    start = bucket_start = 0
    in_bucket = 0
    end = 0
    for i in reversed(range(len(params))):
        p = params[i]
        if distributed_optimizer:
            start = _pad(start, PARAM_START_ALIGN)
            if p.shared_embedding and in_bucket:
                bucket_end = _pad(start, math.lcm(dp, BUCKET_END_ALIGN))
                buckets.append((bucket_start, bucket_end))
                start = bucket_start = bucket_end
                in_bucket = 0
        end = start + p.numel
        spans[i] = (start, end)
        in_bucket += 1
        if distributed_optimizer and p.shared_embedding:
            bucket_end = _pad(end, math.lcm(dp, BUCKET_END_ALIGN))
            buckets.append((bucket_start, bucket_end))
            start = bucket_start = bucket_end
            in_bucket = 0
        else:
            start = end
    if in_bucket:
        buckets.append((bucket_start, _pad(end, math.lcm(dp, BUCKET_END_ALIGN)) if distributed_optimizer else end))
    return [spans[i] for i in range(len(params))], buckets


def _shard_elements(spans: List[Tuple[int, int]], buckets: List[Tuple[int, int]], dp: int, dp_rank: int) -> List[int]:
    """Per parameter: how many of its elements fall in rank `dp_rank`'s 1/DP of its bucket (ZeRO-1)."""
    out = []
    for s, e in spans:
        b0, b1 = next(b for b in buckets if b[0] <= s < b[1] or (s == e and b[0] <= s <= b[1]))
        shard = (b1 - b0) // dp
        lo, hi = b0 + dp_rank * shard, b0 + (dp_rank + 1) * shard
        out.append(max(0, min(e, hi) - max(s, lo)))
    return out


# ------------------------------------------------------------------------------------------ bytes per rank
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def _moment_bytes(cfg) -> int:
    """Bytes per parameter of the optimizer's moments: Adam/LAMB keep two (fp32 unless --exp-avg-dtype and
    --exp-avg-sq-dtype say otherwise with --optimizer-step-fusion)."""
    if cfg.optimizer_step_fusion:
        return DTYPE_BYTES[cfg.exp_avg_dtype] + DTYPE_BYTES[cfg.exp_avg_sq_dtype]
    return 8


def _ddp_bytes(cfg, params: List[Param], dp: int, edp: int, dp_rank: int, edp_rank: int) -> StateBytes:
    zero1 = cfg.zero_stage == 1
    param_bytes = 2 if (cfg.bf16 or cfg.fp16) else 4
    grad_bytes = 2 if cfg.grad_reduce_in_bf16 else 4
    half = cfg.bf16 or cfg.fp16
    # the optimizer's bytes per element it owns: moments, plus an fp32 main copy of a half-precision weight
    # (an fp32 weight is its own main weight: the optimizer holds a view); --cpu-offload keeps them on the host
    opt_bytes = 0 if cfg.cpu_offload else _moment_bytes(cfg) + (4 if half else 0)
    weights = grads = optimizer = 0
    for expert in (False, True):
        group = [p for p in params if p.expert == expert]
        if not group:
            continue
        size, rank = (edp, edp_rank) if expert else (dp, dp_rank)
        spans, buckets = buffer_layout(group, size, zero1)
        numel = buckets[-1][1]
        grads += numel * grad_bytes
        if zero1:
            weights += numel * param_bytes  # the parameters are views of one buffer
            optimizer += sum(_shard_elements(spans, buckets, size, rank)) * opt_bytes
        else:
            weights += sum(p.numel for p in group) * param_bytes
            optimizer += sum(p.numel for p in group) * opt_bytes
    return StateBytes(weights, grads, optimizer)


# Megatron-FSDP (ZeRO-2, optim_grads) communicates in units of this many elements (models/build.py)
FSDP_UNIT_ELEMENTS = 40_000_000


def _fsdp_groups(params: List[Param]) -> List[Tuple[bool, List[Param], int]]:
    """Megatron-FSDP's parameter groups (megatron_fsdp/param_and_grad_buffer.py `_get_parameter_groups`): dense and
    expert parameters apart, cut after FSDP_UNIT_ELEMENTS, the shared embedding alone; each group's parameters
    sorted by row size (largest first) and its chunk factor, the rows' common multiple where they do not nest."""
    buckets: List[Tuple[bool, List[Param]]] = []
    for expert in dict.fromkeys(".experts." in p.name for p in params):
        bucket: List[Param] = []
        for p in (q for q in params if (".experts." in q.name) == expert):
            if p.shared_embedding:
                if bucket:
                    buckets.append((expert, bucket))
                buckets.append((expert, [p]))
                bucket = []
                continue
            bucket.append(p)
            if sum(q.numel for q in bucket) >= FSDP_UNIT_ELEMENTS:
                buckets.append((expert, bucket))
                bucket = []
        if bucket:
            buckets.append((expert, bucket))
    out = []
    for expert, bucket in buckets:
        ordered = sorted(bucket, key=lambda q: -q.row)
        factor = ordered[0].row
        for q in ordered:
            if not (q.row == factor or (factor % q.row == 0 and q.numel % factor == 0) or q.numel < factor):
                factor = math.lcm(factor, q.row)
        out.append((expert, ordered, factor))
    return out


def _fsdp_offsets(sizes: List[int], factor: int) -> Tuple[List[int], int]:
    """Each item's offset and the unpadded end (`build_data_parallel_buffer_index`): items laid in whole chunks
    of `factor`, a partial chunk shared with the first later item whose remainder fits, gaps filled by the small
    items (those under one chunk) in their order, the rest of them at the end."""
    small = [(i, n) for i, n in enumerate(sizes) if n < factor]
    regular = [(i, n) for i, n in enumerate(sizes) if n >= factor]
    offset: Dict[int, int] = {}
    index = 0
    while regular:
        i, n = regular.pop(0)
        offset[i] = index
        if n % factor == 0:
            index += n
            continue
        gap = index + n
        index += (n // factor + 1) * factor
        remain = n % factor
        space = factor - remain
        for k, (j, m) in enumerate(regular):
            if m % factor and remain + m % factor <= factor:
                regular.pop(k)
                offset[j] = index - m % factor
                space -= m % factor
                index += m // factor * factor
                break
        for item in small[:]:
            if item[1] <= space:
                offset[item[0]] = gap
                space -= item[1]
                gap += item[1]
                small.remove(item)
    for j, m in small:
        offset[j] = index
        index += m
    return [offset[i] for i in range(len(sizes))], index


def _fsdp_bytes(cfg, params: List[Param], dp: int, edp: int, dp_rank: int, edp_rank: int) -> StateBytes:
    """ZeRO-2 (Megatron-FSDP optim_grads): every group's weights whole on each rank; its fp32 gradients, fp32 main
    weights and the optimizer's moments only for this rank's 1/DP of the group (padded to DP x chunk factor)."""
    param_bytes = 2 if (cfg.bf16 or cfg.fp16) else 4
    weights = grads = optimizer = 0
    for expert, group, factor in _fsdp_groups(params):
        size, rank = (edp, edp_rank) if expert else (dp, dp_rank)
        sizes = [p.numel for p in group]
        offsets, end = _fsdp_offsets(sizes, factor)
        padded = _pad(end, size * factor)
        shard = padded // size if size > 1 else padded
        lo, hi = (rank * shard, (rank + 1) * shard) if size > 1 else (0, padded)
        weights += padded * param_bytes
        grads += shard * 4
        owned = sum(max(0, min(o + n, hi) - max(o, lo)) for o, n in zip(offsets, sizes))
        optimizer += shard * 4 + owned * _moment_bytes(cfg)
    return StateBytes(weights, grads, optimizer)


@dataclass(frozen=True)
class RankPosition:
    """Where a global rank sits: its pipeline stage and data-parallel positions (dense and expert)."""
    pp: int
    dp: int
    edp: int


def rank_position(cfg, world_size: int, rank: int) -> RankPosition:
    """megatron-core's default rank order, tp-cp-ep-dp-pp (tp fastest; experts: etp-ep-edp within a stage)."""
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    per_stage = world_size // pp
    dp = per_stage // tp
    within = rank % per_stage
    ep, etp = cfg.expert_model_parallel_size, cfg.expert_tp_size
    return RankPosition(pp=rank // per_stage, dp=(within // tp) % dp, edp=within // (etp * ep))


def rank_state_bytes(cfg, vocab_size: int, world_size: int, rank: int) -> StateBytes:
    """Bytes of weights, gradient buffers and optimizer state on global rank `rank` of a `world_size` run."""
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    dp = world_size // (tp * pp)
    edp = world_size // (pp * cfg.expert_model_parallel_size * cfg.expert_tp_size)
    pos = rank_position(cfg, world_size, rank)
    total = StateBytes(0, 0, 0)
    for v in range(cfg.virtual_pipeline_model_parallel_size or 1):
        params = chunk_params(cfg, vocab_size, pos.pp, v)
        fn = _fsdp_bytes if cfg.zero_stage == 2 else _ddp_bytes
        b = fn(cfg, params, dp, edp, pos.dp, pos.edp)
        total = StateBytes(total.weights + b.weights, total.grads + b.grads, total.optimizer + b.optimizer)
    return total


def total_params(cfg, vocab_size: int) -> int:
    """Parameters of the whole model (TP1, PP1, EP1): tied embeddings counted once."""
    one = cfg.replace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                      num_layers_per_virtual_pipeline_stage=None, expert_model_parallel_size=1,
                      expert_tensor_parallel_size=None, padded_vocab_size=cfg.padded_vocab_size)
    return sum(p.numel for p in chunk_params(one, vocab_size))
