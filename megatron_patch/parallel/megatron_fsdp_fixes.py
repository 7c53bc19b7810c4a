"""Three fixes to megatron-core 0.19.2's Megatron-FSDP (our ZeRO-2) for pipeline parallelism.

Megatron-FSDP with `data_parallel_sharding_strategy="optim_grads"` shards gradients and optimizer
state across data-parallel ranks. In megatron-core 0.19.2 it breaks as soon as PP > 1:

  1. Its adapter builds the (dp, tp) device mesh by reshaping `arange(world_size)`, which assumes
     world = dp x tp and fails with PP. Fix: build this stage's mesh from the actual DP and TP groups.
  2. With tied embeddings, `finalize_model_grads` all-reduces the embedding gradient between the first
     and last stage, but under FSDP each rank holds an uneven DP *shard* of it (different rows on the
     two stages), and then assigns the shard to `weight.grad`. Fix: gather the full gradient over the
     mesh, all-reduce it across the embedding group, copy back this rank's slice.
  3. `make_fsdp_dtensor(run_check=True)` validates DTensor metadata with an all_gather_object over the
     *world* group; the stages hold different parameters, so the collectives mis-pair. Fix: skip that
     debug-only check.

`apply()` is idempotent and only changes behaviour on the paths above (dense models, EP = 1).
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

TESTED_MEGATRON_CORE = ("0.19.2",)
_APPLIED = False


def apply() -> None:
    global _APPLIED
    if _APPLIED:
        return
    import megatron.core.distributed.fsdp.mcore_fsdp_adapter as adapter
    import megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer as pgb
    import megatron.core.distributed.finalize_model_grads  # noqa: F401  (module object below)

    original_mesh = adapter._get_dp_tp_mesh

    def dp_tp_mesh(dp_cp_group, tp_group, ep_size=1):
        if ep_size != 1:
            return original_mesh(dp_cp_group, tp_group, ep_size)
        me = dist.get_rank()
        dp = dist.get_process_group_ranks(dp_cp_group)
        tp = dist.get_process_group_ranks(tp_group) if tp_group is not None else [me]
        return torch.tensor([[d + (t - me) for t in tp] for d in dp])  # mesh[dp][tp] = global rank

    adapter._get_dp_tp_mesh = dp_tp_mesh

    fmg = sys.modules["megatron.core.distributed.finalize_model_grads"]
    original_embedding = fmg._allreduce_embedding_grad

    def allreduce_embedding_grad(model, embd_group, pp_group, weight_getter, skip_if_none=True, config=None):
        if not getattr(model[0].ddp_config, "use_megatron_fsdp", False):
            return original_embedding(model, embd_group, pp_group, weight_getter, skip_if_none, config)
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
        offsets = grad._local_tensor.__create_chunk_list__()[0].offsets
        mine = tuple(slice(o, o + n) for o, n in zip(offsets, grad._local_tensor.shape))
        grad._local_tensor.copy_(full[mine])

    fmg._allreduce_embedding_grad = allreduce_embedding_grad

    original_dtensor = pgb.make_fsdp_dtensor

    def make_fsdp_dtensor(*args, **kwargs):
        kwargs["run_check"] = False
        return original_dtensor(*args, **kwargs)

    pgb.make_fsdp_dtensor = make_fsdp_dtensor
    _APPLIED = True
