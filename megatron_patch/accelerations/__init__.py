"""The acceleration switches for Hugging Face (plain torch.nn.Module) models.

    check_combination(args)                           before any worker starts: impossible combinations, in words
    accelerate(model, args, device, optimizer=None)   -> Accelerated(model, optimizer, precision, applied)

One module per switch, each a short function of the model (and the config), built on torch.distributed
(DDP, FSDP2 `fully_shard`, ZeroRedundancyOptimizer) and torch (checkpointing, torch.compile, autocast):

    padding_free.py              --padding-free (packed rows: the model's forward and attention function)
    lora.py                      --lora-rank (peft's LoRA adapters; the rest frozen)
    activation_checkpointing.py  --checkpoint-activations
    onnx_runtime.py              --onnx-runtime-training (ORTModule; optional extra, see compat/onnx_runtime.py)
    data_parallel.py             DDP; --zero-2/--oss-sdp and --zero-3/--fsdp (FSDP2), FSDP2 CPU offload
    compile.py                   --torch-compile, --torch-compile-mode
    optimizers.py                --optimizers; --zero-1/--oss (ZeroRedundancyOptimizer)
    cpu_offload.py               --cpu-offload without FSDP2 (optimizer state and step on the CPU)
    precision.py                 --mixed-precision (fp16 + dynamic loss scaling), --bf16
    combinations.py              check_combination

The order `accelerate` applies them in, and why
------------------------------------------------
0. padding-free               the Hugging Face model's forward also takes packed rows (its attention function is
                              swapped for one that attends within each sample); first, because it needs the model
                              itself: LoRA's PeftModel calls this forward, and every wrapper below calls the model.
   LoRA (peft)                wraps the plain model first: every later switch and the optimizer see the PeftModel,
                              whose trainable parameters are the adapters (and a task head); a given optimizer is
                              rebuilt over them with its class and defaults.
1. activation checkpointing   marks the layers to recompute; it must see the plain Hugging Face model, and
                              FSDP2's hooks must end up outside the recomputed region.
2. ONNX Runtime (ORTModule)   exports the plain (checkpointed) model; DDP then wraps ORTModule.
3. FSDP2 or DDP               ZeRO-2/3 shard the model in place (one unit per layer, then the root), with
                              FSDP2's CPUOffloadPolicy under --cpu-offload; otherwise DDP (also for ZeRO-1).
                              With one worker (or no process group) nothing is wrapped.
4. torch.compile              after the wrapping: per FSDP2 layer unit, or the whole model inside DDP.
5. optimizer                  over the final parameters (FSDP2's shards): --optimizers (apex fused when it
                              can run, else torch AdamW / LAMB), then the CPU-offload wrapper, then
                              ZeroRedundancyOptimizer (ZeRO-1/OSS) around them.
6. Precision                  autocast dtype and the loss scaler for the step.

The partitioning stages (one switch at most, see combinations.py):
    ZeRO-1 / OSS   optimizer state sharded          DDP + ZeroRedundancyOptimizer(optimizer_class=...)
    ZeRO-2 / SDP   + gradients                      FSDP2 fully_shard(reshard_after_forward=False)
    ZeRO-3 / FSDP  + parameters                     FSDP2 fully_shard(reshard_after_forward=True)
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch

from .activation_checkpointing import apply_activation_checkpointing
from .combinations import check_combination, flag, partitioning
from .compile import apply_compile, eager_evaluation, mark_step, uses_cuda_graphs
from .cpu_offload import CPUOffloadOptimizer, offloaded
from .data_parallel import apply_ddp, apply_fsdp, world_size
from .layers import find_layers
from .onnx_runtime import apply_onnx_runtime, ort_available
from .optimizers import (FUSED_VS_SHARDED_SCALER, build_optimizer, choose_optimizer, constructor_kwargs, fused,
                         has_state, remap_groups, weight_decay_groups)
from .precision import Precision, clip_grad_norm, precision_for

__all__ = ["Accelerated", "accelerate", "check_combination", "Precision", "CPUOffloadOptimizer", "offloaded",
           "find_layers", "ort_available", "clip_grad_norm", "uses_cuda_graphs", "mark_step", "eager_evaluation"]

_LABEL = {"zero_1_memory_optimization": "ZeRO-1", "oss_memory_optimization": "OSS",
          "zero_2_memory_optimization": "ZeRO-2", "oss_sdp_memory_optimization": "SDP",
          "zero_3_memory_optimization": "ZeRO-3", "fsdp_memory_optimization": "FSDP"}
_PROMISE = {1: "optimizer state sharded", 2: "optimizer state and gradients sharded",
            3: "optimizer state, gradients and parameters sharded"}


@dataclasses.dataclass
class Accelerated:
    model: torch.nn.Module          # wrapped: DDP / FSDP2 / ORTModule / compiled as applied
    optimizer: torch.optim.Optimizer
    precision: Precision
    applied: List[str]              # one short phrase per applied switch, for a log line


def accelerate(model: torch.nn.Module, args, device: torch.device,
               optimizer: Optional[torch.optim.Optimizer] = None) -> Accelerated:
    """Apply the switches in `args` in the documented order (module docstring). Without `optimizer` one is
    built from --optimizers with Hugging Face's weight-decay groups. A given optimizer is kept when its
    parameters stay the same; with FSDP2 (ZeRO-2/3), ZeRO-1 or --cpu-offload it is rebuilt over the final
    parameters with the same class and param-group hyper-parameters (it must not have stepped yet), and a
    fused torch optimizer under --mixed-precision with several workers is rebuilt unfused (optimizers.py
    FUSED_VS_SHARDED_SCALER). `applied` says which."""
    check_combination(args)
    device = torch.device(device)
    world = world_size()
    stage, stage_attr = partitioning(args)
    offload = bool(getattr(args, "cpu_offload", False))
    lora = bool(getattr(args, "lora_rank", 0))
    fsdp = world > 1 and stage >= 2
    zero_1 = world > 1 and stage == 1
    # fp16 with several workers scales with ShardedGradScaler, which breaks torch's fused AdamW when that is the
    # optimizer it steps (not under ZeroRedundancyOptimizer or the CPU-offload wrapper): see optimizers.py
    fused_breaks = world > 1 and bool(getattr(args, "mixed_precision", False)) and not zero_1 \
        and not (offload and not fsdp)
    unfuse = optimizer is not None and fused_breaks and fused(optimizer)
    rebuild = fsdp or zero_1 or offload or unfuse or lora
    if rebuild and has_state(optimizer):
        raise ValueError("accelerate(): the given optimizer already has state (it has stepped or loaded a "
                         "checkpoint), but the memory switches rebuild it over new parameters and would drop it; "
                         "pass a fresh optimizer and load its state into the one accelerate() returns")
    applied: List[str] = []
    # 0. padding-free, then LoRA
    if getattr(args, "padding_free", False):
        from .padding_free import apply_padding_free

        applied.append(apply_padding_free(model))
    if lora:
        from .lora import apply_lora

        model, phrase = apply_lora(model, args)
        applied.append(phrase)
    base = model.to(device)
    names = {id(p): n for n, p in base.named_parameters()}

    # 1. activation checkpointing
    if getattr(args, "checkpoint_activations", False):
        applied.append(apply_activation_checkpointing(base))
    # 2. ONNX Runtime
    if getattr(args, "onnx_runtime_training", False):
        model, phrase = apply_onnx_runtime(model, device)
        applied.append(phrase)
    # 3. FSDP2 or DDP
    fsdp_layers = None
    if fsdp:
        model, fsdp_layers, how = apply_fsdp(model, device, reshard_after_forward=stage == 3, cpu_offload=offload)
        applied.append(f"{_LABEL[stage_attr]}: {_PROMISE[stage]} ({how})")
    elif world > 1:
        model, how = apply_ddp(model, device)
        applied.append(how)
    elif stage:
        applied.append(f"{_LABEL[stage_attr]} ({flag(stage_attr)}): one worker, nothing to shard; trains unsharded")
    # 4. torch.compile
    if getattr(args, "torch_compile", False):
        applied.append(apply_compile(model, fsdp_layers, getattr(args, "torch_compile_mode", None), device))
    # 5. optimizer
    step_device = torch.device("cpu") if offload else device
    offload_wrapper = offload and not fsdp
    if optimizer is None:
        groups = weight_decay_groups(base, args.weight_decay)
        cls, kwargs, what = choose_optimizer(args, step_device, sharded=fsdp, sharded_scaler=fused_breaks)
        optimizer, phrases = build_optimizer(groups, cls, kwargs, cpu_offload=offload_wrapper, zero_1=zero_1)
        applied.append(f"optimizer: {what}, weight decay {args.weight_decay:g} except biases and norm weights")
    elif rebuild and lora:  # the given optimizer holds the frozen base, not the new adapters
        cls = type(optimizer)
        optimizer, phrases = build_optimizer(weight_decay_groups(base, args.weight_decay), cls,
                                             constructor_kwargs(cls, optimizer.defaults), cpu_offload=offload_wrapper,
                                             zero_1=zero_1)
        applied.append(f"optimizer: the given {cls.__name__} rebuilt over the LoRA adapters with its class and "
                       f"defaults")
    elif rebuild:
        cls = type(optimizer)
        groups = remap_groups(optimizer, names, dict(base.named_parameters()))
        kwargs = constructor_kwargs(cls, optimizer.defaults)
        if unfuse:
            kwargs["fused"] = False
            for g in groups:
                g.pop("fused", None)
        optimizer, phrases = build_optimizer(groups, cls, kwargs, cpu_offload=offload_wrapper, zero_1=zero_1)
        over = "FSDP2's sharded parameters" if fsdp else "the same parameters"
        applied.append(f"optimizer: the given {cls.__name__} rebuilt over {over} with the same class and "
                       f"param-group hyper-parameters" + (f" ({FUSED_VS_SHARDED_SCALER})" if unfuse else ""))
    else:
        phrases = []
        applied.append(f"optimizer: the given {type(optimizer).__name__}, unchanged")
    applied += phrases
    if zero_1:
        local = type(optimizer.optim).__name__
        applied.append(f"{_LABEL[stage_attr]}: {_PROMISE[1]} across {world} workers (ZeroRedundancyOptimizer over "
                       f"{local}; DDP all-reduces whole gradients)")
    # 6. precision
    precision = precision_for(args, device)
    applied.append(precision.describe(onnx_runtime=bool(getattr(args, "onnx_runtime_training", False))))
    return Accelerated(model=model, optimizer=optimizer, precision=precision, applied=applied)
