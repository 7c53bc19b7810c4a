"""Changes to the torch optimizer that megatron-core's optimizer wrappers hold (`wrapper.optimizer`).

megatron-core 0.19.2 builds that torch optimizer itself (torch Adam/AdamW when neither Transformer Engine
nor apex is installed) and offers no LAMB and no way to ask torch for its fused kernel. Called by
megatron_patch/training/optimizer.py right after `get_megatron_optimizer`.
"""
from __future__ import annotations

import weakref
from typing import Callable, Dict, List

import torch

from .registry import original, register, replace

_BUILDER = "megatron/core/optimizer/__init__.py:_get_megatron_optimizer_based_on_param_groups"


def _wrappers(optimizer) -> List:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


@register(upstream=(_BUILDER, "megatron/core/optimizer/optimizer.py:MegatronOptimizer.__init__"),
          fixes="megatron-core builds only its own choice of torch optimizer (Adam/AdamW/SGD...; no LAMB) into each "
                "wrapper: swap the wrapper's torch optimizer for another over the same param groups, which keep "
                "megatron-core's own keys (wd_mult, lr_mult, ...) and drop the old optimizer's defaults",
          fingerprint="f4538167efeda5c2")
def replace_torch_optimizer(optimizer, make: Callable[[List[Dict]], torch.optim.Optimizer]) -> None:
    """For each wrapper in `optimizer` (a megatron-core optimizer or ChainedOptimizer), set
    `wrapper.optimizer = make(param_groups)`; `param_groups` are copies of the old groups (same parameter
    objects, so the wrapper's bookkeeping still matches) without the old optimizer's hyper-parameter keys
    other than lr and weight_decay, which megatron-core's scheduler sets per group."""
    for w in _wrappers(optimizer):
        old = w.optimizer
        drop = set(getattr(old, "defaults", {})) - {"lr", "weight_decay"}
        groups = [{k: v for k, v in g.items() if k not in drop} for g in old.param_groups]
        w.optimizer = make(groups)


@register(upstream=(_BUILDER, "torch/optim/adam.py:Adam.__init__"),
          fixes="megatron-core constructs torch Adam/AdamW without `fused`, so torch picks its foreach kernels: on a "
                "GPU, flip the param groups to torch's fused CUDA kernel after construction",
          fingerprint="c81f0e5f6a733176")
def use_fused_adam(optimizer) -> None:
    """Set `fused=True, foreach=False` on every param group of the wrappers' torch optimizers (GPU only)."""
    for w in _wrappers(optimizer):
        for g in w.optimizer.param_groups:
            g["fused"], g["foreach"] = True, False


@register(upstream=("megatron/core/optimizer/optimizer.py:MegatronOptimizer._filter_and_reorder_param_groups",
                    "megatron/core/optimizer/distrib_optimizer.py:DistributedOptimizer.load_state_dict",
                    "megatron/core/optimizer_param_scheduler.py:OptimizerParamScheduler.get_lr"),
          fixes="megatron-core pairs a checkpoint's param groups with the optimizer's by their settings, the lr range "
                "(max_lr, min_lr) included, and loading gives the groups the saved values, which the scheduler reads "
                "before its own: a resume with another --lr fails ('Could not find parameter group') and "
                "--override-opt-param-scheduler could not change the range. Set every group's range: to the "
                "checkpoint's before loading, to the schedule that wins after",
          fingerprint="f23b996b91ccb050")
def set_param_group_lr_range(optimizer, max_lr: float, min_lr: float) -> None:
    """Set `max_lr` and `min_lr` of every param group of `optimizer` (a megatron-core optimizer or ChainedOptimizer).
    The engine builds every group from one --lr / --min-lr (no per-group overrides), so one range fits all."""
    for group in optimizer.param_groups:
        group["max_lr"], group["min_lr"] = float(max_lr), float(min_lr)


_FLOAT16 = "megatron/core/optimizer/optimizer.py:Float16OptimizerWithFloat16Params"


class _ClipSlot:
    """Where the deferring clip (below) leaves one wrapper's clipping factor for its fused step."""
    coef = None


# id(main parameter) -> (weak reference to it, its wrapper's slot). Kept off the tensors themselves: attributes on
# a tensor are pickled with it. The weak reference guards against a later tensor that reuses a freed one's id.
_DEFERRED: Dict[int, tuple] = {}


def _slot_of(p):
    entry = _DEFERRED.get(id(p))
    return entry[1] if entry is not None and entry[0]() is p else None


def _grads_as_views(self) -> None:
    # Instead of upstream's `main_param.grad = model_param.main_grad.float()`: the buffer itself (no fp32 copy).
    for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
        for model_param, main_param in zip(model_group, main_group):
            main_param.grad = getattr(model_param, "main_grad", None)
            if main_param.grad is None:
                main_param.grad = model_param.grad
            model_param.grad = None
    for model_group in self.fp32_from_fp32_groups:
        for model_param in model_group:
            model_param.grad = model_param.main_grad


def _clip_or_defer(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """megatron-core's clip_grad_by_total_norm_fp32, except for main parameters of a fused wrapper: for those the
    same factor, min(1, max_norm / (total_norm + 1e-6)), is left for the fused step to apply."""
    from megatron.core.optimizer import optimizer as mcore_optimizer

    params = [parameters] if torch.is_tensor(parameters) else list(parameters)
    slots = [_slot_of(p) for p in params]
    deferred = [s for s in slots if s is not None]
    if deferred:
        coef = max_norm / (total_norm + 1.0e-6)
        coef = coef.clamp_max(1.0) if torch.is_tensor(coef) else torch.tensor([min(coef, 1.0)], dtype=torch.float32)
        deferred[0].coef = coef
    rest = [p for p, s in zip(params, slots) if s is None]
    if rest:
        original(mcore_optimizer, "clip_grad_by_total_norm_fp32")(rest, max_norm, total_norm, use_decoupled_grad)


@register(upstream=(f"{_FLOAT16}._copy_model_grads_to_main_grads", f"{_FLOAT16}._copy_main_params_to_model_params",
                    "megatron/core/optimizer/optimizer.py:MixedPrecisionOptimizer.step_with_ready_grads",
                    "megatron/core/optimizer/optimizer.py:MixedPrecisionOptimizer.step",
                    "megatron/core/optimizer/optimizer.py:MegatronOptimizer.clip_grad_norm",
                    "megatron/core/optimizer/optimizer.py:ChainedOptimizer.step",
                    "megatron/core/optimizer/clip_grads.py:clip_grad_by_total_norm_fp32"),
          fixes="megatron-core's bf16 optimizer copies every gradient to fp32, scales the copies to clip, runs torch's "
                "Adam, then copies every fp32 weight back to bf16 (four passes): point the main parameters' grads at "
                "the gradient buffer, leave clipping's factor to the step, and step each wrapper with one fused "
                "function that also writes the bf16 weights",
          fingerprint="0f8f92ff42929ba9")
def fuse_optimizer_step(optimizer, step: Callable, check: Callable) -> tuple:
    """For each Float16OptimizerWithFloat16Params in `optimizer` (bf16, no loss scaler): grads become views of the
    gradient buffer, clipping is deferred, and `step(torch_optimizer, {id(main): model param}, coef)` replaces
    torch's step plus the main -> model copy. `check(torch_optimizer)` raises for an optimizer `step` cannot run.
    Returns (tensors, elements) stepped by it. Raises ValueError for any other kind of wrapper."""
    from types import MethodType

    from megatron.core.optimizer import optimizer as mcore_optimizer

    count = numel = 0
    for w in _wrappers(optimizer):
        if type(w).__name__ != "Float16OptimizerWithFloat16Params" or getattr(w, "grad_scaler", None) is not None:
            raise ValueError(f"--optimizer-step-fusion runs with --bf16 and without ZeRO or CPU offload (megatron-core's "
                             f"Float16OptimizerWithFloat16Params); this run has {type(w).__name__}"
                             + (" with a loss scaler" if getattr(w, "grad_scaler", None) is not None else ""))
        if w.is_stub_optimizer:
            continue
        check(w.optimizer)
        slot = _ClipSlot()
        models = {}
        for model_group, main_group in zip(w.float16_groups, w.fp32_from_float16_groups):
            for model_param, main_param in zip(model_group, main_group):
                models[id(main_param)] = model_param
        for group in w.optimizer.param_groups:
            for p in group["params"]:
                _DEFERRED[id(p)] = (weakref.ref(p), slot)
                p.grad_dtype = None  # torch >= 2.10 refuses a bf16 .grad on an fp32 tensor unless told so
                count, numel = count + 1, numel + p.numel()

        def step_with_ready_grads(self, slot=slot, models=models) -> bool:
            coef, slot.coef = slot.coef, None
            with torch.no_grad():
                step(self.optimizer, models, coef)
            return True

        w._copy_model_grads_to_main_grads = MethodType(_grads_as_views, w)
        w.step_with_ready_grads = MethodType(step_with_ready_grads, w)
    replace(mcore_optimizer, "clip_grad_by_total_norm_fp32", _clip_or_defer)
    return count, numel
