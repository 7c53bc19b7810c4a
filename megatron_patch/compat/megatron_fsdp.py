"""Megatron-FSDP (our ZeRO-2) in megatron-core 0.19.2: three fixes for pipeline parallelism, and the three
private/internal entry points our checkpointing needs.

With `data_parallel_sharding_strategy="optim_grads"` Megatron-FSDP shards gradients and optimizer state
across data-parallel ranks; in megatron-core 0.19.2 it breaks as soon as PP > 1. The three fixes
(`dp_tp_mesh_from_groups`, `fsdp_tied_embedding_grad`, `skip_dtensor_world_check`) are applied together by
`megatron_patch.compat.apply_megatron_fsdp_fixes()` before the first FullyShardedDataParallel is built; they
change behaviour only on the paths below (dense models, EP = 1).

`use_distributed_params`, `copy_main_to_model_params` and `prepare_uneven_dtensor_state` are called by
the checkpointing code for ZeRO-2 checkpoints; `use_raw_params` by conversion's verify, which reads a loaded
ZeRO-2 model's compute weights.
"""
from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

from .registry import original, register, replace

_FMG = "megatron.core.distributed.finalize_model_grads"


def mesh_from_ranks(me: int, dp_ranks: List[int], tp_ranks: List[int]) -> torch.Tensor:
    """The (dp, tp) mesh of global ranks of this rank's pipeline stage: mesh[i][j] = dp_ranks[i] + (tp_ranks[j] - me)."""
    return torch.tensor([[d + (t - me) for t in tp_ranks] for d in dp_ranks])


@register(upstream="megatron/core/distributed/fsdp/mcore_fsdp_adapter.py:_get_dp_tp_mesh",
          fixes="builds the (dp, tp) device mesh by reshaping arange(world_size), which assumes world = dp x tp and "
                "fails with PP > 1: build this stage's mesh from the actual DP and TP groups",
          fingerprint="c7a64d6fd324ceec")
def dp_tp_mesh_from_groups() -> None:
    import megatron.core.distributed.fsdp.mcore_fsdp_adapter as adapter

    upstream = original(adapter, "_get_dp_tp_mesh")

    def dp_tp_mesh(dp_cp_group, tp_group, ep_size=1):
        if ep_size != 1:
            return upstream(dp_cp_group, tp_group, ep_size)
        me = dist.get_rank()
        tp = dist.get_process_group_ranks(tp_group) if tp_group is not None else [me]
        return mesh_from_ranks(me, dist.get_process_group_ranks(dp_cp_group), tp)

    replace(adapter, "_get_dp_tp_mesh", dp_tp_mesh)


@register(upstream=("megatron/core/distributed/finalize_model_grads.py:_allreduce_embedding_grad",
                    "megatron/core/distributed/finalize_model_grads.py:_get_main_grad_attr",
                    "megatron/core/distributed/fsdp/src/megatron_fsdp/uneven_dtensor.py:uneven_dtensor_to_full_tensor"),
          fixes="with tied embeddings it all-reduces the embedding gradient between first and last stage, but under "
                "Megatron-FSDP each rank holds an uneven DP shard of it (different rows on the two stages): gather the "
                "full gradient over the DP mesh, all-reduce it across the embedding group, copy back this rank's slice",
          fingerprint="21fe9448a403d3dc")
def fsdp_tied_embedding_grad() -> None:
    import importlib

    fmg = importlib.import_module(_FMG)  # the package re-exports a *function* of the same name
    upstream = original(fmg, "_allreduce_embedding_grad")

    def allreduce_embedding_grad(model, embd_group, pp_group, weight_getter, skip_if_none=True, config=None):
        if not getattr(model[0].ddp_config, "use_megatron_fsdp", False):
            return upstream(model, embd_group, pp_group, weight_getter, skip_if_none, config)
        from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import uneven_dtensor_to_full_tensor
        from megatron.core.utils import get_attr_wrapped_model

        if embd_group is None or dist.get_world_size(embd_group) <= 1 or \
                dist.get_rank() not in dist.get_process_group_ranks(embd_group):
            return
        chunk = model[0] if fmg.is_pp_first_stage(pp_group) else model[-1]
        chunk = get_attr_wrapped_model(chunk, "pre_process", return_model_obj=True)
        weight = weight_getter(chunk)
        if weight is None and skip_if_none:
            return
        grad = getattr(weight, fmg._get_main_grad_attr(weight))
        if grad is None and skip_if_none:
            return
        full = uneven_dtensor_to_full_tensor(grad)
        dist.all_reduce(full, group=embd_group)
        local = grad._local_tensor  # not to_local(): the uneven-shard chunk metadata sits on this very object
        offsets = local.__create_chunk_list__()[0].offsets
        mine = tuple(slice(o, o + n) for o, n in zip(offsets, local.shape))
        local.copy_(full[mine])

    replace(fmg, "_allreduce_embedding_grad", allreduce_embedding_grad)


@register(upstream=("megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py:make_fsdp_dtensor",
                    "megatron/core/transformer/fsdp_dtensor_checkpoint.py:handle_swiglu_in_state_dict"),
          fixes="make_fsdp_dtensor(run_check=True) validates DTensor metadata with an all_gather_object over the "
                "*world* group; pipeline stages hold different parameters, so the collectives mis-pair and hang: "
                "skip that debug-only check (also where the checkpoint's SwiGLU split calls it with run_check=True)",
          fingerprint="2278a946fafb0de0")
def skip_dtensor_world_check() -> None:
    import megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer as pgb
    import megatron.core.transformer.fsdp_dtensor_checkpoint as checkpoint_helpers

    upstream = original(pgb, "make_fsdp_dtensor")

    def make_fsdp_dtensor(*args, **kwargs):
        kwargs["run_check"] = False
        return upstream(*args, **kwargs)

    replace(pgb, "make_fsdp_dtensor", make_fsdp_dtensor)
    replace(checkpoint_helpers, "make_fsdp_dtensor", make_fsdp_dtensor)  # imported by name there


def _call_on_wrappers(model_chunks, method: str) -> None:
    """`method()` of every module in each chunk's chain of wrappers (`.module`) that has it."""
    for chunk in model_chunks:
        m = chunk
        while m is not None:
            if hasattr(m, method):
                getattr(m, method)()
            m = getattr(m, "module", None)


@register(upstream="megatron/core/distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py:"
                   "MegatronFSDP._replace_param_with_distributed_if_needed",
          fixes="a forward pass without backward (evaluation) leaves Megatron-FSDP's modules holding their raw "
                "parameters, while checkpoints and the optimizer refer to the sharded DTensor ones; only this "
                "private method puts those back",
          fingerprint="8bcbd9a02bda769b")
def use_distributed_params(model_chunks) -> None:
    """Put the sharded DTensor parameters back on every (wrapped) module of `model_chunks`."""
    _call_on_wrappers(model_chunks, "_replace_param_with_distributed_if_needed")


@register(upstream="megatron/core/distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py:"
                   "MegatronFSDP._replace_param_with_raw_if_needed",
          fixes="outside a forward pass Megatron-FSDP's modules hold the sharded DTensor parameters; the raw (compute) "
                "parameters a forward pass uses, whole over DP, are put back only by this private method (or by a "
                "forward pass itself)",
          fingerprint="0e96149f035bfb28")
def use_raw_params(model_chunks) -> None:
    """Put the raw compute parameters (this rank's TP part, whole over DP) back on every (wrapped) module of
    `model_chunks`, as a forward pass does: conversion's verify copies a loaded ZeRO-2 model's weights from them."""
    _call_on_wrappers(model_chunks, "_replace_param_with_raw_if_needed")


@register(upstream="megatron/core/optimizer/distrib_optimizer.py:DistributedOptimizer._copy_main_params_to_model_params",
          fixes="under Megatron-FSDP with bf16 the compute weights are a copy of the fp32 main weights that only an "
                "optimizer step refreshes; after loading main weights from a checkpoint, only this private method "
                "refreshes them",
          fingerprint="80e4f4d1fa99e747")
def copy_main_to_model_params(optimizer) -> None:
    """Copy the fp32 main weights into the model (compute) weights, for every optimizer of a chain."""
    for w in getattr(optimizer, "chained_optimizers", [optimizer]):
        w._copy_main_params_to_model_params()


@register(upstream="megatron/core/distributed/fsdp/src/megatron_fsdp/uneven_dtensor.py:"
                   "preprocess_state_dict_for_uneven_dtensor",
          fixes="Megatron-FSDP shards unevenly, which torch.distributed.checkpoint cannot describe; this helper "
                "(only importable from megatron-core's internal src path) attaches the chunk metadata DCP needs",
          fingerprint="cc482d258730d2de")
def prepare_uneven_dtensor_state(state_dict: dict) -> dict:
    """`state_dict` with the uneven-shard metadata attached to its DTensors, ready for dcp.save/dcp.load."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import preprocess_state_dict_for_uneven_dtensor

    return preprocess_state_dict_for_uneven_dtensor(state_dict)
