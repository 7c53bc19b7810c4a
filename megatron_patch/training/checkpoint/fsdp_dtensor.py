"""Backend for ZeRO-2 runs (Megatron-FSDP): its DTensor state through torch.distributed.checkpoint.

Megatron-FSDP shards parameters, gradients and optimizer state unevenly over data-parallel ranks;
the checkpoint holds those DTensors under names with *global* layer numbers (each pipeline stage
numbers its layers from 0), plus one RNG file per (PP, TP) rank. It loads at any DP size (DCP reshards the
DTensors) with the same TP/PP/EP; another TP/PP/EP is refused in words (the DTensors hold TP-local shapes).
"""
from __future__ import annotations

import os
import re
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core import parallel_state as mpu

from megatron_patch.compat.adam_state import fill_empty_adam_state, steps_on_param_device
from megatron_patch.compat.megatron_fsdp import (
    copy_main_to_model_params, prepare_uneven_dtensor_state, use_distributed_params,
)

from . import rng
from .torch_dist import unwrap

FORMAT = "fsdp_dtensor"
OPT_METADATA = {"distrib_optim_sharding_type": "fsdp_dtensor"}


def _global_layer_names(chunk) -> Callable[[str], str]:
    model = unwrap(chunk)
    stack = "decoder" if hasattr(model, "decoder") else "encoder"  # GPTModel's layers, BertModel's
    layers = getattr(model, stack).layers
    offsets = {i: layer.layer_number - 1 for i, layer in enumerate(layers)}
    pattern = re.compile(rf"{stack}\.layers\.(\d+)\.")
    return lambda name: pattern.sub(lambda m: f"{stack}.layers.{offsets[int(m.group(1))]}.", name, count=1)


def _rename_param_keys(optimizer_state: Dict, rename: Callable[[str], str]) -> Dict:
    """The fsdp_dtensor optimizer dict keys its per-parameter entries by parameter name."""
    return {k: ({rename(n): x for n, x in v.items()} if k in ("state", "param_to_group_meta") else v)
            for k, v in optimizer_state.items()}


def _state(model: List, optimizer, is_loading: bool) -> Dict:
    use_distributed_params(model)
    fill_empty_adam_state(optimizer)  # ranks with an empty shard must still describe the same keys
    rename = _global_layer_names(model[0])
    opt = optimizer.sharded_state_dict({}, is_loading=is_loading, metadata=OPT_METADATA)
    state = {"model": {rename(k): v for k, v in unwrap(model[0]).state_dict().items()},
             "optimizer": _rename_param_keys(opt, rename)}
    return prepare_uneven_dtensor_state(state)


def _rng_file(path: str) -> str:
    k = rng.layout_key()
    return os.path.join(path, f"rng_pp{k['pp']}_tp{k['tp']}.pt")


def save(path: str, model: List, optimizer, consume_model: bool = False) -> None:
    # consume_model is a torch_dist matter (views of fc1); DTensor shards own their storage
    dcp.save(_state(model, optimizer, is_loading=False), checkpoint_id=path)
    if mpu.get_data_parallel_rank() == 0:
        torch.save(rng.capture(), _rng_file(path))


def load(path: str, model: List, optimizer, load_optimizer: bool, load_rng: bool, without_adapters: bool = False) -> None:
    state = _state(model, optimizer, is_loading=True)
    if not load_optimizer:
        del state["optimizer"]
    dcp.load(state, checkpoint_id=path)
    rename = _global_layer_names(model[0])
    local = {rename(n): n for n in [*unwrap(model[0]).state_dict(), *(n for n, _ in model[0].named_parameters())]}
    unwrap(model[0]).load_state_dict({local[k]: v for k, v in state["model"].items()})
    # The module's parameters are the fp32 main-weight shards; with bf16 the compute weights are a
    # separate copy that only an optimizer step refreshes: refresh it now, and gather it across DP.
    copy_main_to_model_params(optimizer)
    for chunk in model:
        if hasattr(chunk, "start_param_sync"):
            chunk.start_param_sync(force_sync=True)
    if load_optimizer:
        for w in getattr(optimizer, "chained_optimizers", [optimizer]):
            w.load_state_dict(_rename_param_keys(state["optimizer"], lambda n: local.get(n, n)))
        steps_on_param_device(optimizer)
    if load_rng:
        rng.restore(torch.load(_rng_file(path), weights_only=True))
    dist.barrier()
