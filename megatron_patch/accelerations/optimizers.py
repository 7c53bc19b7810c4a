"""`--optimizers apex_adam|apex_lamb`, weight-decay groups, and the optimizer wrappers of the memory
switches: CPU offload (cpu_offload.py) and ZeRO-1/OSS (torch's ZeroRedundancyOptimizer).

Which implementation steps:
  apex_adam  apex FusedAdam (AdamW mode) when apex imports and the step runs on a GPU over plain tensors;
             else torch AdamW, fused=True on a GPU, foreach on the CPU.
  apex_lamb  apex FusedLAMB under the same conditions (its own global-norm clipping off: Precision.step
             clips); else megatron_patch.accelerations.lamb.Lamb.
apex's kernels take plain CUDA tensors: under FSDP2 (DTensor shards) and for a CPU step (--cpu-offload)
torch's implementations run. LAMB's trust ratio needs whole-parameter norms: ZeroRedundancyOptimizer
assigns whole parameters to ranks, and Lamb's `p.norm()` on an FSDP2 DTensor shard is the norm over all
shards, so LAMB is right under every stage.
"""
from __future__ import annotations

import inspect
from typing import Any, Dict, List, Optional, Tuple, Type

import torch

from .lamb import Lamb

from .cpu_offload import offloaded

# torch 2.11: GradScaler.step hands an optimizer with `_step_supports_amp_scaling` (torch's fused Adam/AdamW)
# the summed found-inf tensor, which ShardedGradScaler makes of shape [1] where the fused kernel expects a
# scalar ("output with shape [] doesn't match the broadcast shape [1]", pytorch/pytorch#140514, seen on an H200).
FUSED_VS_SHARDED_SCALER = ("not fused: torch's fused AdamW fails under fp16 loss scaling with several workers, "
                           "pytorch/pytorch#140514")

_NORMS = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.RMSNorm, torch.nn.BatchNorm1d, torch.nn.BatchNorm2d,
          torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm, torch.nn.InstanceNorm1d, torch.nn.InstanceNorm2d,
          torch.nn.InstanceNorm3d)


def _apex(name: str):
    try:
        import apex.optimizers as ao

        return getattr(ao, name)
    except ImportError:
        return None


def weight_decay_groups(model: torch.nn.Module, weight_decay: float) -> List[Dict[str, Any]]:
    """Hugging Face's grouping: biases and normalization weights get no weight decay. A normalization
    layer is a torch norm module or any module whose class name ends in "Norm" (LlamaRMSNorm, T5LayerNorm...)."""
    no_decay, decay, seen = [], [], set()
    for module in model.modules():
        is_norm = isinstance(module, _NORMS) or type(module).__name__.lower().endswith("norm")
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            (no_decay if is_norm or "bias" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def choose_optimizer(args, step_device: torch.device, sharded: bool,
                     sharded_scaler: bool = False) -> Tuple[Type[torch.optim.Optimizer], Dict, str]:
    """(class, constructor kwargs, a description) for --optimizers, for a step on `step_device` over plain
    (sharded=False) or FSDP2-sharded parameters. `sharded_scaler`: fp16 loss scaling with several workers
    (torch's ShardedGradScaler), which breaks torch's fused AdamW (see `FUSED_VS_SHARDED_SCALER`)."""
    kw = dict(lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps, weight_decay=args.weight_decay)
    gpu = step_device.type == "cuda"
    why_not_apex = ("the step runs on the CPU" if not gpu else
                    "apex's kernels take plain CUDA tensors, not FSDP2's DTensor shards" if sharded else
                    "apex not installed")
    use_apex = gpu and not sharded
    if args.optimizers == "apex_lamb":
        fused = _apex("FusedLAMB") if use_apex else None
        if fused is not None:
            return fused, {**kw, "max_grad_norm": 0.0}, "apex FusedLAMB"
        return Lamb, kw, f"LAMB (megatron_patch.accelerations.lamb; {why_not_apex})"
    fused = _apex("FusedAdam") if use_apex else None
    if fused is not None:
        return fused, {**kw, "adam_w_mode": True}, "apex FusedAdam (AdamW mode)"
    if gpu and sharded_scaler:
        return (torch.optim.AdamW, {**kw, "foreach": True},
                f"torch AdamW (foreach; {why_not_apex}; {FUSED_VS_SHARDED_SCALER})")
    if gpu:
        return torch.optim.AdamW, {**kw, "fused": True}, f"torch AdamW (fused CUDA kernel; {why_not_apex})"
    return torch.optim.AdamW, {**kw, "foreach": True}, f"torch AdamW (foreach; {why_not_apex})"


def constructor_kwargs(cls: Type[torch.optim.Optimizer], defaults: Dict[str, Any]) -> Dict[str, Any]:
    """The entries of an optimizer's `defaults` that its class's constructor accepts (torch AdamW's defaults
    carry keys such as `decoupled_weight_decay` that only its base class takes)."""
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in params}


def build_optimizer(groups: List[Dict[str, Any]], cls: Type[torch.optim.Optimizer], kwargs: Dict[str, Any], *,
                    cpu_offload: bool, zero_1: bool, process_group=None) -> Tuple[torch.optim.Optimizer, List[str]]:
    """`cls(groups, **kwargs)`, optionally stepping on the CPU and/or sharded with ZeroRedundancyOptimizer."""
    phrases = []
    if cpu_offload:
        inner_kw = {"foreach": True} if cls is torch.optim.AdamW else {}
        cls = offloaded(cls, **inner_kw)
        phrases.append(f"CPU offload: fp32 master weights, optimizer state and the {cls.inner_class.__name__} step "
                       f"on the CPU (CPUOffloadOptimizer: gradients copied to the host, weights copied back)")
    if zero_1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(groups, optimizer_class=cls, process_group=process_group, **kwargs)
        return opt, phrases
    return cls(groups, **kwargs), phrases


def remap_groups(optimizer: torch.optim.Optimizer, names: Dict[int, str],
                 params_by_name: Dict[str, torch.nn.Parameter]) -> List[Dict[str, Any]]:
    """`optimizer`'s param groups with each parameter replaced by the model's current parameter of the same
    name (FSDP2 replaces parameters by sharded ones), keeping each group's hyper-parameters."""
    groups = []
    for g in optimizer.param_groups:
        params = []
        for p in g["params"]:
            name = names.get(id(p))
            if name is None:
                raise ValueError("the optimizer given to accelerate() holds a tensor that is not a parameter of the "
                                 "model; build it over model.parameters()")
            params.append(params_by_name[name])
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": params})
    return groups


def fused(optimizer: torch.optim.Optimizer) -> bool:
    return bool(optimizer.defaults.get("fused")) or any(g.get("fused") for g in optimizer.param_groups)


def has_state(optimizer: Optional[torch.optim.Optimizer]) -> bool:
    return optimizer is not None and any(len(s) for s in optimizer.state.values())
