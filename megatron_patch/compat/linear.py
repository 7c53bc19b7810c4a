"""megatron-core's column- and row-parallel linears with our own linear function (`--gradient-accumulation-fusion`).

Applied by megatron_patch/models/wgrad_fusion.py to the built model chunks."""
from __future__ import annotations

from typing import Callable, Iterable

import torch

from .registry import register


@register(upstream=("megatron/core/tensor_parallel/layers.py:linear_with_grad_accumulation_and_async_allreduce",
                    "megatron/core/tensor_parallel/layers.py:ColumnParallelLinear.forward",
                    "megatron/core/tensor_parallel/layers.py:RowParallelLinear.forward"),
          fixes="the linears call their private `_forward_impl` (upstream's linear_with_grad_accumulation_and_"
                "async_allreduce, set in __init__) with its keyword arguments; its fused weight-gradient path "
                "needs apex and sets weight attributes in backward that dynamo cannot trace: each linear's "
                "`_forward_impl` becomes make_impl(upstream's), which must take the same keyword arguments",
          fingerprint="4314e71c579c38b4")
def route_linears_through(chunks: Iterable[torch.nn.Module], make_impl: Callable[[Callable], Callable],
                          skip: Callable[[torch.nn.Module], bool] = lambda m: False) -> int:
    """Give every ColumnParallelLinear / RowParallelLinear in `chunks` (but those `skip` names) the forward function
    `make_impl(its current one)`; returns how many."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    count = 0
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and not skip(module):
                module._forward_impl = make_impl(module._forward_impl)
                count += 1
    return count


def count_linears_without_collective(chunks: Iterable[torch.nn.Module],
                                     skip: Callable[[torch.nn.Module], bool] = lambda m: False) -> int:
    """How many ColumnParallelLinear / RowParallelLinear in `chunks` megatron-core calls with no tensor-parallel
    collective inside the linear function (allreduce_dgrad and sequence_parallel both False), as the two forwards
    fingerprinted above pass them: ColumnParallelLinear.forward from its attributes (both False for experts with
    explicit communication), RowParallelLinear.forward always False."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    count = 0
    for chunk in chunks:
        for m in chunk.modules():
            if skip(m):
                continue
            if isinstance(m, RowParallelLinear):
                count += 1
            elif isinstance(m, ColumnParallelLinear):
                count += m.explicit_expert_comm or not (m.allreduce_dgrad or m.sequence_parallel)
    return count
