"""Process groups (megatron-core's parallel_state, exposed as `mpu`), launch from the torchrun
environment. (The CPU backend that lets megatron-core run without a GPU lives in megatron_patch.compat.)"""
from megatron.core import parallel_state as mpu

from .initialize import destroy, initialize, is_last_rank, print_rank_0

__all__ = ["mpu", "initialize", "destroy", "print_rank_0", "is_last_rank"]
