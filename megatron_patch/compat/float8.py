"""torchao's float8 training internals, which our FP8 linear function (models/float8.py) calls directly.

megatron-core's column- and row-parallel linears are not `nn.Linear`, so torchao's public module swap
(`convert_to_float8_training`) does not reach them. Its functional core, the autograd function that casts the
operands of the three GEMMs of a linear and runs them as scaled matmuls (emulated in fp32 with `emulate=True`),
is private; so are the casting helpers we use to cast once with an amax reduced over the tensor-parallel group.
torchao is pinned (setup.py) and these objects are fingerprinted here.
"""
from __future__ import annotations

from types import SimpleNamespace

from .registry import register

TORCHAO_TESTED = "torchao 0.18.0, torch 2.11.x"


@register(upstream=("torchao/float8/float8_linear.py:matmul_with_hp_or_float8_args",
                    "torchao/float8/float8_training_tensor.py:hp_tensor_and_scale_to_float8",
                    "torchao/float8/float8_utils.py:amax_to_scale",
                    "torchao/float8/distributed_utils.py:tensor_already_casted_to_fp8",
                    "torchao/float8/float8_training_tensor.py:LinearMMConfig"),
          fixes="torchao's float8 linear exists only as a module swap for nn.Linear; we call its autograd function "
                "(matmul_with_hp_or_float8_args: operands in high precision are cast per its config, operands "
                "already in float8 are used as they are) from megatron-core's linear function, casting the weight, "
                "the sharded activations and the sharded output gradients ourselves with the amax reduced over the "
                "tensor-parallel group (hp_tensor_and_scale_to_float8, amax_to_scale)",
          fingerprint="c59b9f0e765a383d", tested=TORCHAO_TESTED)
def torchao_float8() -> SimpleNamespace:
    """torchao's float8 training pieces: matmul (matmul_with_hp_or_float8_args), to_float8
    (hp_tensor_and_scale_to_float8), amax_to_scale, is_float8 (tensor_already_casted_to_fp8), LinearMMConfig,
    ScaledMMConfig, GemmInputRole and the recipes' Float8LinearConfig."""
    from torchao.float8.config import Float8LinearConfig
    from torchao.float8.distributed_utils import tensor_already_casted_to_fp8
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
    from torchao.float8.float8_training_tensor import (GemmInputRole, LinearMMConfig, ScaledMMConfig,
                                                       hp_tensor_and_scale_to_float8)
    from torchao.float8.float8_utils import amax_to_scale

    return SimpleNamespace(matmul=matmul_with_hp_or_float8_args, to_float8=hp_tensor_and_scale_to_float8,
                           amax_to_scale=amax_to_scale, is_float8=tensor_already_casted_to_fp8,
                           LinearMMConfig=LinearMMConfig, ScaledMMConfig=ScaledMMConfig, GemmInputRole=GemmInputRole,
                           Float8LinearConfig=Float8LinearConfig)
