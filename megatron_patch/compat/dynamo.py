"""megatron-core under torch.compile (`--compile`): code paths dynamo cannot trace.

Applied by megatron_patch/models/compile.py before the layers are compiled."""
from __future__ import annotations

from .registry import original, register, replace


@register(upstream=("megatron/core/utils.py:get_tensor_model_parallel_group_if_none",
                    "megatron/core/tensor_parallel/layers.py:RowParallelLinear.forward"),
          fixes="RowParallelLinear.forward passes tp_group=None, so every call reaches a DeprecationWarning that "
                "dynamo cannot trace (two graph breaks per transformer layer, and recompiles of the resumed "
                "frames): in tensor_parallel/layers.py, resolve None to the default group without the warning",
          fingerprint="480c971cfcef1ba4")
def tp_group_default_without_warning() -> None:
    """`get_tensor_model_parallel_group_if_none` as megatron/core/tensor_parallel/layers.py sees it -> the same
    resolution (the expert or the plain tensor-parallel group for None) minus the warning."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import layers

    upstream = original(layers, "get_tensor_model_parallel_group_if_none")

    def get_group(tp_group=None, is_expert=False, check_initialized=True):
        if tp_group is None and torch.distributed.is_initialized() and parallel_state.is_initialized():
            if is_expert:
                return parallel_state.get_expert_tensor_parallel_group(check_initialized=check_initialized)
            return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)
        return upstream(tp_group, is_expert=is_expert, check_initialized=check_initialized)

    replace(layers, "get_tensor_model_parallel_group_if_none", get_group)
