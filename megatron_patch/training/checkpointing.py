"""Checkpoints with megatron-core's dist_checkpointing (torch_dist format): model, optimizer, lr
schedule, RNG, iteration and data position.

Layout: `{save}/iter_0000100/` plus `{save}/latest_checkpointed_iteration.txt`. A checkpoint is written
into `iter_XXXXXXX.tmp/`, renamed when every rank has finished, and only then is the tracker file
replaced, so a crash never leaves a checkpoint that looks complete. Model weights load into any TP/PP
layout (dist_checkpointing reshards them); optimizer state follows the model for the plain optimizer
and moves between DP sizes for ZeRO-1; RNG state is restored only into the same layout.
"""
from __future__ import annotations

import os
import random
import shutil
from typing import Dict, Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as mpu
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from megatron_patch.config import Config

TRACKER = "latest_checkpointed_iteration.txt"
OPT_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}
FSDP_METADATA = {"distrib_optim_sharding_type": "fsdp_dtensor"}
FSDP_COMMON = "megatron_patch_common.pt"  # marks a ZeRO-2 (fsdp_dtensor) checkpoint


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_tracker(root: str) -> Optional[int]:
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise ValueError(f"{path}: expected an iteration number, found {text!r}")
    return int(text)


def _layout(cfg: Config) -> Dict[str, int]:
    return {"tp": cfg.tensor_model_parallel_size, "pp": cfg.pipeline_model_parallel_size,
            "dp": cfg.data_parallel_size, "vpp": cfg.virtual_pipeline_model_parallel_size or 1,
            "zero1": int(cfg.zero_1_memory_optimization)}


def _unwrap(m):
    while hasattr(m, "module"):
        m = m.module
    return m


def _model_state(model) -> Dict:
    if len(model) == 1:
        return {"model": _unwrap(model[0]).sharded_state_dict()}
    return {f"model{i}": _unwrap(m).sharded_state_dict() for i, m in enumerate(model)}


def _rng_state() -> ShardedObject:
    state = {"random": random.getstate(), "np": np.random.get_state(), "torch": torch.get_rng_state(),
             "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
             "tracker": get_cuda_rng_tracker().get_states()}
    return ShardedObject("rng_state", state, (dist.get_world_size(),), (dist.get_rank(),), replica_id=0)


def _is_fsdp(model) -> bool:
    return bool(getattr(getattr(model[0], "ddp_config", None), "use_megatron_fsdp", False))


def _fsdp_state(model, optimizer, is_loading: bool) -> Dict:
    """ZeRO-2 (Megatron-FSDP) state as DTensors, saved and loaded with torch.distributed.checkpoint.
    Megatron-FSDP shards unevenly; its helper attaches the chunk metadata DCP needs for that."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import preprocess_state_dict_for_uneven_dtensor

    _distributed_params(model)
    _fill_empty_adam_state(optimizer)
    rename = _global_layer_names(model[0])
    opt = optimizer.sharded_state_dict({}, is_loading=is_loading, metadata=FSDP_METADATA)
    state = {"model": {rename(k): v for k, v in _unwrap(model[0]).state_dict().items()},
             "optimizer": _rename_param_keys(opt, rename)}
    return preprocess_state_dict_for_uneven_dtensor(state)


def _distributed_params(model) -> None:
    """A forward pass without backward (evaluation) leaves Megatron-FSDP's modules holding their raw
    parameters; the checkpoint and the optimizer refer to the sharded DTensor ones: put those back."""
    for chunk in model:
        m = chunk
        while m is not None:
            if hasattr(m, "_replace_param_with_distributed_if_needed"):
                m._replace_param_with_distributed_if_needed()
            m = getattr(m, "module", None)


def _global_layer_names(chunk):
    """Names with *global* layer numbers: every pipeline stage numbers its layers from 0, and one
    torch.distributed.checkpoint namespace must not see two stages' layer 0 under the same key."""
    import re

    layers = _unwrap(chunk).decoder.layers
    offsets = {i: layer.layer_number - 1 for i, layer in enumerate(layers)}
    pattern = re.compile(r"decoder\.layers\.(\d+)\.")
    return lambda name: pattern.sub(lambda m: f"decoder.layers.{offsets[int(m.group(1))]}.", name, count=1)


def _rename_param_keys(optimizer_state: Dict, rename) -> Dict:
    """The fsdp_dtensor optimizer dict keys its per-parameter entries by parameter name."""
    return {k: ({rename(n): x for n, x in v.items()} if k in ("state", "param_to_group_meta") else v)
            for k, v in optimizer_state.items()}


def _steps_on_param_device(optimizer) -> None:
    """torch's fused AdamW keeps `step` on the parameter's device, but its load_state_dict leaves it on the
    CPU when the loaded param groups do not say `fused`: move it back."""
    for w in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = w.optimizer
        for group in inner.param_groups:
            if not (group.get("fused") or group.get("capturable")):
                continue
            for p in group["params"]:
                st = inner.state.get(p, {})
                if torch.is_tensor(st.get("step")):
                    st["step"] = st["step"].to(p.device)


def _fill_empty_adam_state(optimizer) -> None:
    """Give every parameter of torch Adam/AdamW zero state where it has none yet.

    Two callers need it: megatron-core's distributed optimizer reads that state (including `step`) to
    build the dict it loads into, but torch creates it only at the first step; and under Megatron-FSDP a
    parameter whose shard is empty on this rank never gets state, so the ranks would describe different
    checkpoint keys and the collective metadata exchange would hang."""
    for w in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(w, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        steps = [st["step"] for st in inner.state.values() if "step" in st]
        for group in inner.param_groups:
            on_device = group.get("fused") or group.get("capturable")  # such steps live with the params
            for p in group["params"]:
                if not inner.state[p]:
                    step = steps[0].clone() if steps else torch.zeros((), dtype=torch.float32)
                    inner.state[p] = {"step": step.to(p.device if on_device else "cpu"),
                                      "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}


def save_checkpoint(cfg: Config, iteration: int, model, optimizer, scheduler, consumed_samples: int) -> str:
    """Write checkpoint `iteration` under --save (collective: every rank calls it)."""
    final = checkpoint_dir(cfg.save, iteration)
    tmp = final + ".tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    common = dict(iteration=iteration, consumed_samples=consumed_samples, opt_param_scheduler=scheduler.state_dict(),
                  layout=_layout(cfg))
    if _is_fsdp(model):
        import torch.distributed.checkpoint as dcp

        dcp.save(_fsdp_state(model, optimizer, is_loading=False), checkpoint_id=tmp)
        torch.save(_rng_state().data, os.path.join(tmp, f"rng_{dist.get_rank()}.pt"))
        if dist.get_rank() == 0:
            torch.save(common, os.path.join(tmp, FSDP_COMMON))
    else:
        state = _model_state(model)
        state["optimizer"] = optimizer.sharded_state_dict(state, metadata=OPT_METADATA)
        state.update(common, rng_state=_rng_state())
        dist_checkpointing.save(state, tmp)
    dist.barrier()
    if dist.get_rank() == 0:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        with open(os.path.join(cfg.save, TRACKER + ".tmp"), "w") as f:
            f.write(str(iteration))
        os.replace(os.path.join(cfg.save, TRACKER + ".tmp"), os.path.join(cfg.save, TRACKER))
    dist.barrier()
    return final


def _set_rng(rng: Dict) -> None:
    random.setstate(rng["random"])
    np.random.set_state(rng["np"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    get_cuda_rng_tracker().set_states(rng["tracker"])


def _load_fsdp(cfg: Config, path: str, model, optimizer, scheduler, load_optimizer: bool) -> Dict[str, int]:
    import torch.distributed.checkpoint as dcp

    common = torch.load(os.path.join(path, FSDP_COMMON), weights_only=False)
    if common["layout"] != _layout(cfg):
        raise ValueError(f"{path} is a ZeRO-2 checkpoint of layout {common['layout']}; it loads only into the same "
                         f"layout (this run: {_layout(cfg)}). Resume with the same TP/PP/DP and ZeRO-2.")
    if not _is_fsdp(model):
        raise ValueError(f"{path} is a ZeRO-2 checkpoint: resume it with --zero-2-memory-optimization")
    state = _fsdp_state(model, optimizer, is_loading=True)
    if not load_optimizer:
        del state["optimizer"]
    dcp.load(state, checkpoint_id=path)
    rename = _global_layer_names(model[0])
    local = {rename(n): n for n in [*_unwrap(model[0]).state_dict(), *(n for n, _ in model[0].named_parameters())]}
    _unwrap(model[0]).load_state_dict({local[k]: v for k, v in state["model"].items()})
    # The module's parameters are the fp32 main-weight shards; with bf16 the compute weights are a
    # separate copy that only an optimizer step refreshes: refresh it now, and gather it across DP.
    for w in getattr(optimizer, "chained_optimizers", [optimizer]):
        w._copy_main_params_to_model_params()
    for chunk in model:
        if hasattr(chunk, "start_param_sync"):
            chunk.start_param_sync(force_sync=True)
    if load_optimizer:
        for w in getattr(optimizer, "chained_optimizers", [optimizer]):
            w.load_state_dict(_rename_param_keys(state["optimizer"], lambda n: local.get(n, n)))
        _steps_on_param_device(optimizer)
        scheduler.load_state_dict(common["opt_param_scheduler"])
    _set_rng(torch.load(os.path.join(path, f"rng_{dist.get_rank()}.pt"), weights_only=False))
    if dist.get_rank() == 0:
        print(f"loaded checkpoint {path} (iteration {common['iteration']}, ZeRO-2)", flush=True)
    return {"iteration": common["iteration"], "consumed_samples": common["consumed_samples"]}


def _restore_adam_step(optimizer, loaded_optimizer) -> None:
    """megatron-core 0.19.2's distributed optimizer restores torch Adam's per-parameter `step` from the
    parameter-state shards, which do not carry it (they hold _fill_empty_adam_state's placeholder), after setting it
    correctly from the param groups; put the param groups' step back so bias correction resumes exactly."""
    groups = (loaded_optimizer.get("optimizer") or {}).get("param_groups") if isinstance(loaded_optimizer, dict) else None
    steps = {g["step"] for g in groups or [] if "step" in g}
    if len(steps) != 1:
        return
    step = float(steps.pop())
    for w in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(w, "optimizer", None)
        for state in getattr(inner, "state", {}).values():
            if "step" in state and torch.is_tensor(state["step"]):
                state["step"] = torch.tensor(step, dtype=state["step"].dtype, device=state["step"].device)


def load_checkpoint(cfg: Config, model, optimizer, scheduler, load_optimizer: bool = True) -> Dict[str, int]:
    """Restore from --load; returns {"iteration", "consumed_samples"} (zeros when there is no checkpoint)."""
    iteration = read_tracker(cfg.load)
    if iteration is None:
        if dist.get_rank() == 0:
            print(f"no checkpoint in --load {cfg.load} ({TRACKER} missing): starting from scratch", flush=True)
        return {"iteration": 0, "consumed_samples": 0}
    path = checkpoint_dir(cfg.load, iteration)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{cfg.load}/{TRACKER} names iteration {iteration}, but {path} does not exist")
    if os.path.isfile(os.path.join(path, FSDP_COMMON)):
        return _load_fsdp(cfg, path, model, optimizer, scheduler, load_optimizer)
    common = dist_checkpointing.load_common_state_dict(path)
    same_layout = common.get("layout") == _layout(cfg)
    zero1_moved = common.get("layout", {}).get("zero1") and not same_layout and any(
        common["layout"][k] != _layout(cfg)[k] for k in ("tp", "pp", "vpp", "zero1"))
    load_optimizer = load_optimizer and not zero1_moved
    state = _model_state(model)
    if load_optimizer:
        _fill_empty_adam_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=True, metadata=OPT_METADATA)
    if same_layout:
        state["rng_state"] = _rng_state()
    loaded = dist_checkpointing.load(state, path)
    for i, m in enumerate(model):
        _unwrap(m).load_state_dict(loaded["model" if len(model) == 1 else f"model{i}"])
    if load_optimizer:
        with torch.no_grad():
            optimizer.load_state_dict(loaded["optimizer"])
        _restore_adam_step(optimizer, loaded["optimizer"])
        scheduler.load_state_dict(common["opt_param_scheduler"])
    else:
        # The model may live in other buffers now: refresh the optimizer's fp32 main copies from it.
        if hasattr(optimizer, "reload_model_params"):
            optimizer.reload_model_params()
    if same_layout:
        _set_rng(loaded["rng_state"])
    if dist.get_rank() == 0:
        notes = []
        if not same_layout:
            notes.append(f"layout {common.get('layout')} -> {_layout(cfg)}: weights resharded, RNG not restored")
        if zero1_moved:
            notes.append("ZeRO-1 optimizer state moves only between DP sizes: optimizer and lr schedule start fresh")
        print(f"loaded checkpoint {path} (iteration {iteration})" + ("; " + "; ".join(notes) if notes else ""), flush=True)
    return {"iteration": common["iteration"], "consumed_samples": common["consumed_samples"]}
