"""megatron-core's Mixture-of-Experts layers (router, token dispatchers, SequentialMLP experts) on the CPU.

With the CPU backend (cpu_backend.py) in place, megatron-core's MoELayer built from the local spec
(`get_gpt_layer_local_spec(num_experts=..., moe_grouped_gemm=False)`: TopKRouter, SequentialMLP of
Column/RowParallelLinear, allgather or alltoall dispatcher, with moe_permute_fusion / moe_router_fusion off)
runs on the CPU except where listed here. Applied with the CPU backend (order `CPU_BACKEND`), on machines
without a GPU only; a model without experts never reaches the patched code.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable, List

import torch

from .registry import original, register, replace


@register(upstream=("megatron/core/transformer/moe/moe_utils.py:maybe_move_tensor_to_cpu",
                    "megatron/core/transformer/moe/token_dispatcher.py:"
                    "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize",
                    "megatron/core/tensor_parallel/mappings.py:_AllToAll.forward"),
          fixes="the alltoall dispatcher turns its all-to-all split sizes into numpy arrays only when they are CUDA "
                "tensors (maybe_move_tensor_to_cpu(..., as_numpy=True)); on the CPU they stay torch tensors, which "
                "torch.distributed.all_to_all_single refuses as split sizes (TypeError from alltoall_base): "
                "give CPU tensors asked for as numpy the numpy array too",
          fingerprint="813234976ca9550d")
def moe_alltoall_splits_as_numpy() -> None:
    """`maybe_move_tensor_to_cpu(t, as_numpy=True)` for a CPU tensor -> a numpy copy of it (the GPU path's
    result type). Replaced where MoEAlltoAllTokenDispatcher calls it (token_dispatcher.py imports it by name)
    and in moe_utils."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    upstream = original(moe_utils, "maybe_move_tensor_to_cpu")

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.detach().clone().numpy()  # a copy, as the device-to-host transfer makes on a GPU
        return upstream(tensor, as_numpy=as_numpy, record_stream=record_stream)

    replace(moe_utils, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)
    replace(token_dispatcher, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)


def _uneven(sizes, group) -> bool:
    return sizes is not None and len(set(int(s) for s in sizes)) > 1 and \
        torch.distributed.get_backend(group) == "gloo"


@register(upstream=("megatron/core/tensor_parallel/mappings.py:_gather_along_first_dim",
                    "megatron/core/tensor_parallel/mappings.py:_reduce_scatter_along_first_dim"),
          fixes="the alltoall dispatcher with expert tensor parallelism (ETP > 1) all-gathers / reduce-scatters "
                "a different number of tokens per ETP rank (output_split_sizes / input_split_sizes) with "
                "torch.distributed.all_gather / reduce_scatter on lists of uneven tensors, which gloo refuses "
                "('ProcessGroupGloo::allgather: invalid tensor size'): on gloo, pad every rank's rows to the "
                "largest count and use the equal-size collectives",
          fingerprint="68e18bab08360e47")
def moe_uneven_gather_scatter_on_gloo() -> None:
    """megatron-core's `_gather_along_first_dim(..., output_split_sizes)` and
    `_reduce_scatter_along_first_dim(..., input_split_sizes)` with unequal sizes on a gloo group -> padded
    all_gather_into_tensor / reduce_scatter_tensor, then the padding cut off. Equal sizes, no sizes, or NCCL:
    upstream's own code. Serves MoEAlltoAllTokenDispatcher.dispatch_postprocess / combine_preprocess (and
    their backward) when ETP > 1."""
    import megatron.core.tensor_parallel.mappings as mappings

    upstream_gather = original(mappings, "_gather_along_first_dim")
    upstream_scatter = original(mappings, "_reduce_scatter_along_first_dim")

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if not _uneven(output_split_sizes, group):
            return upstream_gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(s) for s in output_split_sizes]
        width = max(sizes)
        padded = input_.new_zeros((width,) + tuple(input_.shape[1:]))
        padded[: input_.size(0)] = input_
        out = input_.new_empty((width * len(sizes),) + tuple(input_.shape[1:]))
        torch.distributed.all_gather_into_tensor(out, padded, group=group)
        return torch.cat([out[r * width: r * width + n] for r, n in enumerate(sizes)])

    def _reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if not _uneven(input_split_sizes, group):
            return upstream_scatter(input_, group, input_split_sizes, use_global_buffer)
        sizes = [int(s) for s in input_split_sizes]
        width = max(sizes)
        padded = input_.new_zeros((width * len(sizes),) + tuple(input_.shape[1:]))
        for r, chunk in enumerate(torch.split(input_, sizes, dim=0)):
            padded[r * width: r * width + chunk.size(0)] = chunk
        out = input_.new_empty((width,) + tuple(input_.shape[1:]))
        torch.distributed.reduce_scatter_tensor(out, padded, group=group)
        return out[: sizes[group.rank()]].contiguous()

    replace(mappings, "_gather_along_first_dim", _gather_along_first_dim)
    replace(mappings, "_reduce_scatter_along_first_dim", _reduce_scatter_along_first_dim)


@register(upstream=("megatron/core/transformer/moe/experts.py:SequentialMLP.forward",
                    "megatron/core/transformer/mlp.py:MLP.forward",
                    "torch/__init__.py:_grouped_mm"),
          fixes="SequentialMLP runs its experts one after the other (two GEMMs each over that expert's rows); "
                "megatron-core's grouped-GEMM experts need Transformer Engine or the "
                "grouped_gemm package: each SequentialMLP's `forward` becomes make_forward(the module), which must "
                "compute what upstream's does (the expert MLP of MLP.forward, non-fused activation branch) from "
                "the same parameters; torch._grouped_mm is private (bf16/fp32, CPU and CUDA in torch 2.11)",
          fingerprint="420140d264b23c14")
def route_experts_through(chunks: Iterable[torch.nn.Module], make_forward: Callable[[torch.nn.Module], Callable]) -> int:
    """Give every SequentialMLP (the experts of an MoELayer) in `chunks` the forward `make_forward(module)`;
    returns how many."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    modules = _modules_of(chunks, SequentialMLP)
    for module in modules:
        module.forward = make_forward(module)
    return len(modules)


def _modules_of(chunks: Iterable[torch.nn.Module], cls: type) -> List[torch.nn.Module]:
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, cls)]


@register(upstream=("megatron/core/transformer/moe/moe_layer.py:MoELayer.preprocess",
                    "megatron/core/transformer/moe/moe_layer.py:MoELayer.dispatch",
                    "megatron/core/transformer/moe/moe_layer.py:MoELayer.routed_experts_compute",
                    "megatron/core/transformer/moe/moe_layer.py:MoELayer.combine",
                    "megatron/core/transformer/moe/moe_layer.py:MoELayer.postprocess",
                    "megatron/core/transformer/moe/token_dispatcher.py:MoEAlltoAllTokenDispatcher.dispatch_preprocess",
                    "megatron/core/transformer/moe/token_dispatcher.py:MoEAlltoAllTokenDispatcher.combine_postprocess"),
          fixes="megatron-core's token dispatchers read the tokens per expert on the host in every MoE layer (split "
                "sizes, the permutation's size); at EP 1 each layer's `token_dispatcher` (which MoELayer calls through "
                "dispatch_preprocess, token_dispatch, dispatch_postprocess, combine_preprocess, token_combine, "
                "combine_postprocess, get_expert_zero_copy_buffers) becomes make(layer), one with static shapes "
                "(models/moe_dispatch.py), where make returns one",
          fingerprint="36512d814e1c8ec4")
def use_token_dispatcher(chunks: Iterable[torch.nn.Module], make: Callable[[torch.nn.Module], object]) -> int:
    """Set every MoELayer's `token_dispatcher` in `chunks` to `make(layer)` unless that is None; returns how many."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    count = 0
    for layer in _modules_of(chunks, MoELayer):
        new = make(layer)
        if new is not None:
            layer.token_dispatcher = new
            count += 1
    return count


@register(upstream=("megatron/core/transformer/moe/moe_logging.py:MoEMetricsTracker.report",
                    "megatron/core/transformer/moe/moe_logging.py:MoEMetricsTracker._sync_metrics",
                    "megatron/core/transformer/moe/moe_logging.py:MoEMetricsTracker._aggregate",
                    "megatron/core/transformer/moe/moe_logging.py:MoEMetricsTracker._count_moe_layers"),
          fixes="the tracker's report() formats its scalars into a log string (a host read of each, every step: the "
                "GPU waits at the end of every step); the same reduction and mean over MoE layers, kept on the device, "
                "and the tracker cleared, without the string",
          fingerprint="299f238c7387dc49")
def moe_tracked_means(tracker, names: List[str], loss_scale: float, num_layers: int, moe_layer_freq) -> Dict:
    """{name: 0-dim tensor on the device}: what tracker.report(..., force_initialize=True) puts into its
    total_loss_dict for `names` (reduced over PP / TP / DP, times loss_scale, the mean over MoE layers); clears the
    tracker."""
    for name in names:
        tracker.ensure_initialized(name, num_layers)
    tracker._sync_metrics(names, None)
    moe_layers = tracker._count_moe_layers(num_layers, moe_layer_freq, None)
    out = tracker._aggregate(loss_scale, moe_layers, names, None)
    tracker.clear()
    return out


@register(upstream=("megatron/core/transformer/moe/moe_logging.py:MoEMetricsTracker.record",
                    "megatron/core/transformer/moe/moe_logging.py:MoEMetricsTracker.ensure_initialized",
                    "megatron/core/transformer/moe/moe_logging.py:MoEMetricsTracker.clear"),
          fixes="the tracker creates a metric's per-layer tensor at the first record(), inside the router's "
                "forward: under --compile-mode reduce-overhead that tensor is an output of the first CUDA graph, and "
                "the next step's in-place add into it fails (a graph's output is overwritten by its next replay). "
                "Create the tracked metrics' tensors before the first step and mark their addresses static, so "
                "that CUDA graphs update them in place (clear() zeroes them in place, keeping the address)",
          fingerprint="14cc064094a3075f")
def tracker_tensors_before_capture(tracker, names: List[str], num_layers: int, device,
                                   extra: Iterable[torch.Tensor] = ()) -> None:
    """Create `tracker`'s entries for `names` ([num_layers] zeros on `device`) and mark them, and the tensors of
    `extra` (other per-step accumulators a compiled layer adds into), as static addresses for CUDA graphs."""
    for name in names:
        tracker.ensure_initialized(name, num_layers, device)
    for t in [tracker._metrics[n].values for n in names] + list(extra):
        torch._dynamo.mark_static_address(t)


@register(upstream=("megatron/core/tensor_parallel/mappings.py:reduce_from_tensor_model_parallel_region",
                    "megatron/core/tensor_parallel/mappings.py:reduce_scatter_to_sequence_parallel_region",
                    "megatron/core/tensor_parallel/mappings.py:_reduce",
                    "megatron/core/tensor_parallel/mappings.py:_reduce_scatter_along_first_dim",
                    "megatron/core/tensor_parallel/layers.py:RowParallelLinear.forward",
                    "megatron/core/transformer/mlp.py:MLP.forward"),
          fixes="an expert's linear_fc2 (RowParallelLinear) at expert tensor-parallel size 1 without expert "
                "parallelism still reduces its output through _ReduceFromModelParallelRegion (or, with "
                "--sequence-parallel, _ReduceScatterToSequenceParallelRegion), which over one rank returns its input "
                "as-is, so autograd marks the output a view made inside a custom Function; MLP.forward then adds the "
                "expert's bias in place (`output += output_bias ... * per_token_scale`) and autograd refuses "
                "('Output 0 of _ReduceFromModelParallelRegionBackward is a view and is being modified inplace'): "
                "over a group of one rank, return the input without the autograd Function (a reduction over one "
                "rank is the identity, forward and backward)",
          fingerprint="09a0cd2cee8a0f4c")
def one_rank_reductions_are_identity() -> None:
    """`reduce_from_tensor_model_parallel_region(x, group)` and `reduce_scatter_to_sequence_parallel_region(x,
    group)` with a group of one rank -> `x` itself, where megatron-core defines them (mappings) and where
    RowParallelLinear calls them (layers imports them by name); any other group: upstream's. Applied where a
    model with experts and linear biases is built (models/gpt.py)."""
    import megatron.core.tensor_parallel.layers as layers
    import megatron.core.tensor_parallel.mappings as mappings

    upstream_reduce = original(mappings, "reduce_from_tensor_model_parallel_region")
    upstream_scatter = original(mappings, "reduce_scatter_to_sequence_parallel_region")

    def reduce_from_tensor_model_parallel_region(input_, group=None):
        group = mappings.get_tensor_model_parallel_group_if_none(group)
        return input_ if group.size() == 1 else upstream_reduce(input_, group)

    def reduce_scatter_to_sequence_parallel_region(input_, group=None, input_split_sizes=None,
                                                   use_global_buffer=False):
        group = mappings.get_tensor_model_parallel_group_if_none(group)
        if group.size() == 1:
            return input_
        return upstream_scatter(input_, group, input_split_sizes, use_global_buffer)

    for module in (mappings, layers):
        replace(module, "reduce_from_tensor_model_parallel_region", reduce_from_tensor_model_parallel_region)
        replace(module, "reduce_scatter_to_sequence_parallel_region", reduce_scatter_to_sequence_parallel_region)


@register(upstream=("megatron/core/tensor_parallel/layers.py:RowParallelLinear.__init__",
                    "megatron/core/distributed/finalize_model_grads.py:_allreduce_non_tensor_model_parallel_grads"),
          fixes="RowParallelLinear marks its bias `sequence_parallel` whenever --sequence-parallel is on, experts' "
                "too; finalize_model_grads then sums the gradients of such parameters over the tensor-parallel "
                "group, although an expert's gradients are already reduced over its expert data-parallel group, "
                "which spans the tensor-parallel ranks at expert tensor-parallel size 1 (the only size megatron-core "
                "allows expert biases at): the expert linear_fc2 bias gradient came out TP times too large. Clear "
                "the mark on experts' biases",
          fingerprint="148d0816b1a69db9")
def expert_biases_not_sequence_parallel(chunks: Iterable[torch.nn.Module]) -> int:
    """Set `sequence_parallel = False` on the bias of every expert RowParallelLinear in `chunks` (built model
    chunks, before training); returns how many."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    count = 0
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, RowParallelLinear) and module.is_expert and module.bias is not None:
                module.bias.sequence_parallel = False
                count += 1
    return count


@register(upstream=("megatron/core/distributed/distributed_data_parallel.py:DistributedDataParallel.__init__",
                    "megatron/core/optimizer/__init__.py:_get_param_groups"),
          fixes="megatron-core marks expert weights `allreduce=False` (reduced over the expert data-parallel group, "
                "in buffers and an optimizer of their own) only when EP > 1 or ETP != TP; at EP 1 they join the dense "
                "parameters, so the optimizer's checkpoint keys (`chained_0.` / `chained_1.` at EP > 1, none at EP 1) "
                "change with EP and its state cannot move between EP 1 and EP > 1. Marked at EP 1 too, the experts "
                "are reduced over the same ranks (the expert data-parallel group is the data-parallel group then) "
                "and the optimizer has the same two parts at every EP",
          fingerprint="25e06e5429650edc")
def expert_params_apart(chunks: Iterable[torch.nn.Module]) -> int:
    """Mark every expert weight of `chunks` (the SequentialMLP / grouped experts of each MoELayer) `allreduce=False`;
    returns how many. Before the DDP wrapper and the optimizer are built."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    count = 0
    for layer in _modules_of(chunks, MoELayer):
        for p in layer.experts.parameters():
            if getattr(p, "allreduce", True):
                p.allreduce = False
                count += 1
    return count
