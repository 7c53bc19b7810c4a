"""Data parallelism for Hugging Face models: DDP (plain data parallel, and ZeRO-1/OSS underneath
ZeroRedundancyOptimizer) or FSDP2 `fully_shard` (ZeRO-2/SDP and ZeRO-3/FSDP).

FSDP2 shards every parameter on dim 0 across the ranks (DTensor, placement Shard(0)); one unit per
transformer layer (`find_layers`), then the root for the rest (embeddings, heads). Gradients are
reduce-scattered, so each rank keeps only its shard of them (ZeRO-2), and the optimizer, built over
the sharded parameters afterwards, only holds state for that shard.

  ZeRO-2 / SDP   reshard_after_forward=False: parameters are gathered for the forward and stay whole
                 until the backward has used them (no second all-gather); they are sharded between steps.
  ZeRO-3 / FSDP  reshard_after_forward=True, the root included (FSDP2 would otherwise keep the root's
                 parameters whole after forward): between forward and backward each rank holds only its
                 shards, and the backward gathers each layer again.

Precision under FSDP2: autocast (see precision.py), not MixedPrecisionPolicy, which keeps the default
(fp32 parameters, fp32 gradient reduction). A policy with param_dtype=fp16/bf16 would run every op in
the low precision, including the layer norms, softmax and the loss Hugging Face computes inside forward,
where autocast keeps fp32; fp16 loss scaling needs fp32 gradients to unscale; and autocast gives FSDP2
exactly the numerics of DDP and ZeRO-1, so switching the memory stage does not change the training.
The price is all-gathering fp32 parameters (twice the bytes of a bf16 all-gather).
"""
from __future__ import annotations

from typing import List, Tuple

import torch
import torch.distributed as dist

from .layers import find_layers


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's model inside DDP (`module`), torch.compile (`_orig_mod`) and ORTModule (`_original_module`)."""
    while True:
        for attr in ("module", "_orig_mod", "_original_module"):
            inner = getattr(model, attr, None)
            if isinstance(inner, torch.nn.Module):
                model = inner
                break
        else:
            return model


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def apply_ddp(model: torch.nn.Module, device: torch.device) -> Tuple[torch.nn.Module, str]:
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=device_ids)
    return ddp, f"data parallel: DistributedDataParallel over {world_size()} workers (gradients all-reduced)"


def apply_fsdp(model: torch.nn.Module, device: torch.device, reshard_after_forward: bool,
               cpu_offload: bool) -> Tuple[torch.nn.Module, List[torch.nn.Module], str]:
    """Shard `model` in place with FSDP2. Returns (model, the layer units, a description)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(device.type, (world_size(),))
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy()
    kwargs = dict(mesh=mesh, reshard_after_forward=reshard_after_forward, offload_policy=offload,
                  mp_policy=MixedPrecisionPolicy())  # fp32 parameters and reduction: see the module docstring
    layers = find_layers(model)
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    where = ", sharded parameters, gradients and optimizer step on the CPU (FSDP2 CPUOffloadPolicy)" \
        if cpu_offload else ""
    kinds = sorted({type(l).__name__.removeprefix("FSDP") for l in layers})  # fully_shard renames the class
    units = f"{len(layers)} units ({', '.join(kinds)}) + root" if layers else "the root only"
    return model, layers, f"FSDP2 fully_shard over {world_size()} workers, {units}, " \
                          f"reshard_after_forward={reshard_after_forward}{where}"
