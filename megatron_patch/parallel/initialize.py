"""Start the distributed run from the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT) or as a single process, with NCCL on GPUs and gloo plus the CPU backend
(megatron_patch.compat.apply_cpu_backend) otherwise."""
from __future__ import annotations

import datetime
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megatron_patch import compat
from megatron_patch.config import Config
from megatron_patch.ports import free_port


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def initialize(cfg: Config) -> Config:
    """Validate `cfg` for this world size (unless the entry point's validate() already did), then start process
    groups and seed every RNG. Returns the validated Config."""
    compat.quiet_known_noise()  # (a no-op where the entry point already did it)
    world = world_size_from_env()
    if not (cfg.checked and cfg.world_size == world):  # the entry point's validate() is not repeated
        cfg = cfg.validate(world)  # before any process group exists: config errors surface cleanly
    if "RANK" not in os.environ:  # plain `python pretrain_megatron_gpt.py`: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(free_port())))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    compat.check_versions()  # once per process, before any workaround is applied
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        compat.apply_gpu_fixes()
        backend = "nccl"
    else:
        compat.apply_cpu_backend()
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(minutes=30))
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=cfg.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=cfg.expert_model_parallel_size,
        expert_tensor_parallel_size=cfg.expert_tensor_parallel_size,
    )
    # Megatron-LM's seeding: a different stream per pipeline stage, and megatron-core's tracker for TP.
    seed = cfg.seed + 100 * mpu.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return cfg


def destroy() -> None:
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def is_last_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1


def print_rank_0(*args, **kwargs) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)
