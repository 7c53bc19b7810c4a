"""Changes to the torch optimizer that megatron-core's optimizer wrappers hold (`wrapper.optimizer`).

megatron-core 0.19.2 builds that torch optimizer itself (torch Adam/AdamW when neither Transformer Engine
nor apex is installed) and offers no LAMB and no way to ask torch for its fused kernel. Called by
megatron_patch/training/optimizer.py right after `get_megatron_optimizer`.
"""
from __future__ import annotations

from typing import Callable, Dict, List

import torch

from .registry import register

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
