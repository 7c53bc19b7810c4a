"""Backend for ZeRO-0/1 runs: megatron-core's dist_checkpointing in its torch_dist format.

Model weights are ShardedTensors with global shapes, so they load into any TP/PP/VPP layout. The
optimizer state follows the model without ZeRO, and moves between data-parallel sizes with ZeRO-1
(the distributed optimizer's `dp_reshardable` format). The RNG state is one shard per (PP, TP) rank.
"""
from __future__ import annotations

from typing import Dict, List

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import apply_factories

from megatron_patch.compat.adam_state import fill_empty_adam_state, restore_adam_step, steps_kept_out
from megatron_patch.compat.checkpoint_writer import write_results_in_process
from megatron_patch.config.lora_targets import is_adapter

from . import rng

FORMAT = "torch_dist"
# The distributed optimizer's (ZeRO-1) checkpoint format: dp_reshardable (its buffers' shards as they are: fully
# parallel, loads at another DP size only) or, with --dist-ckpt-optim-fully-reshardable, fully_reshardable (each
# model-parallel group's DP rank 0 gathers the state per parameter: loads at any TP/PP/DP). Recorded in the manifest.
DP_RESHARDABLE, FULLY_RESHARDABLE = "dp_reshardable", "fully_reshardable"


def unwrap(m):
    """The model chunk inside its wrappers (Float16Module, DDP, Megatron-FSDP)."""
    while hasattr(m, "module"):
        m = m.module
    return m


def _model_state(model: List) -> Dict:
    if len(model) == 1:
        return {"model": unwrap(model[0]).sharded_state_dict()}
    return {f"model{i}": unwrap(m).sharded_state_dict() for i, m in enumerate(model)}


def _own_storage_then_free(state: Dict, model: List) -> None:
    """Give every tensor of `state` that is a view into a larger storage (the SwiGLU fc1 halves) its own
    copy, one parameter at a time, and free each parameter once nothing views it any more.

    megatron-core's writer clones such views itself (a view would write its whole storage), but all of
    them before writing: one more copy of every fc1 on top of the model. A conversion discards its model
    after saving, so copying layer by layer and freeing the original keeps the peak at one model copy.
    """
    apply_factories(state)  # the factories' chunks are the views; save() applies them again as a no-op
    by_storage: Dict[int, List[ShardedTensor]] = {}
    for v in nested_values(state):
        if isinstance(v, ShardedTensor) and v.data is not None:
            by_storage.setdefault(v.data.untyped_storage().data_ptr(), []).append(v)
    for m in model:
        for p in unwrap(m).parameters():
            views = by_storage.get(p.untyped_storage().data_ptr(), [])
            if any(v.data.untyped_storage().nbytes() != v.data.numel() * v.data.itemsize for v in views):
                for v in views:
                    v.data = v.data.detach().clone()
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)


def _metadata(optim_sharding: str) -> Dict:
    return {"distrib_optim_sharding_type": optim_sharding}


def _state(model: List, optimizer, optim_sharding: str, consume_model: bool = False) -> Dict:
    """This rank's sharded state dict: the weights, and with an optimizer its state and the RNG streams."""
    state = _model_state(model)
    if consume_model:
        _own_storage_then_free(state, model)
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, metadata=_metadata(optim_sharding))
        state["rng_state"] = rng.sharded(rng.capture())
    return state


def save(path: str, model: List, optimizer, consume_model: bool = False, optim_sharding: str = DP_RESHARDABLE) -> None:
    """Write this rank's part of the checkpoint into `path` (collective). Without an optimizer (a converted
    model) only the weights are written: no optimizer state, no RNG streams. `consume_model` (a conversion,
    whose model is not used again) frees parameters while saving, so the peak stays at one model copy."""
    state = _state(model, optimizer, optim_sharding, consume_model)
    write_results_in_process()  # not megatron-core's Manager process, spawned at the first save of each rank
    dist_checkpointing.save(state, path)


def save_async(path: str, model: List, optimizer, optim_sharding: str = DP_RESHARDABLE):
    """--async-save: plan this rank's part of the checkpoint into `path` (collective) and return megatron-core's
    AsyncRequest; its writes (async_save.py runs them) and finalisation come later."""
    write_results_in_process()  # the background thread is of this process: the queue of this process serves it
    return dist_checkpointing.save(_state(model, optimizer, optim_sharding), path, async_sharded_save=True,
                                   async_strategy="mcore")


def load(path: str, model: List, optimizer, load_optimizer: bool, load_rng: bool, without_adapters: bool = False,
         optim_sharding: str = DP_RESHARDABLE) -> None:
    """Read weights (resharded to this layout), optionally the optimizer state and the RNG streams.
    `without_adapters`: the checkpoint has no LoRA adapters (a base model for a LoRA run): they keep their init."""
    state = _model_state(model)
    if without_adapters:
        state = {k: {n: t for n, t in v.items() if not is_adapter(n)} for k, v in state.items()}
    if load_optimizer:
        fill_empty_adam_state(optimizer)  # megatron-core builds the dict it loads into from this state
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=True, metadata=_metadata(optim_sharding))
    if load_rng:
        state["rng_state"] = rng.sharded(None)
    loaded = dist_checkpointing.load(state, path)
    for i, m in enumerate(model):
        missing, unexpected = unwrap(m).load_state_dict(loaded["model" if len(model) == 1 else f"model{i}"],
                                                        strict=not without_adapters)
        if [k for k in missing if not is_adapter(k)] or unexpected:
            raise RuntimeError(f"{path}: the model lacks {unexpected[:3]} / the checkpoint lacks "
                               f"{[k for k in missing if not is_adapter(k)][:3]}")
    if load_optimizer:
        with torch.no_grad(), steps_kept_out(optimizer, optim_sharding == FULLY_RESHARDABLE):
            optimizer.load_state_dict(loaded["optimizer"])
        restore_adam_step(optimizer, loaded["optimizer"])
    elif hasattr(optimizer, "reload_model_params"):
        optimizer.reload_model_params()  # the fp32 main copies must follow the loaded weights
    if load_rng:
        rng.restore(loaded["rng_state"])
