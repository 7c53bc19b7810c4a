"""`mpu` as the how-to's pretraining samples use it (`from megatron import mpu`): megatron-core's parallel state
(`mpu.get_tensor_model_parallel_rank()`, ...) plus `broadcast_data(keys, data, datatype)`.

In a pretraining run only tensor-parallel rank 0 reads batches (the others get `None` from the template's
data iterator); `broadcast_data` sends them to the rest of the tensor-parallel group, so every rank of a
tensor-parallel group computes on the same batch.
"""
from __future__ import annotations

from megatron.core import parallel_state as _ps
from megatron.core.parallel_state import *  # noqa: F401,F403  (the names Megatron-LM's mpu had)

from megatron_patch.parallel.broadcast import broadcast_data  # noqa: F401


def __getattr__(name: str):
    # anything else of megatron-core's parallel state (private helpers included), as megatron's mpu offered
    return getattr(_ps, name)


