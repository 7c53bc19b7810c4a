"""Start the distributed run from the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT) or as a single process, with NCCL on GPUs and gloo plus the CPU backend
(megatron_patch.compat.apply_cpu_backend) otherwise.

megatron-core is imported by the functions that need it, not here: `start_process_group` is also the set-up of the
torch loop (Hugging Face models), whose runs never import megatron-core."""
from __future__ import annotations

import datetime
import os
import random

import numpy as np
import torch
import torch.distributed as dist

from megatron_patch import compat
from megatron_patch.config import Config
from megatron_patch.config.restart import max_restarts, restart_count
from megatron_patch.ports import free_port

from .watchdog import start_watchdog, stop_watchdog


def current_device() -> torch.device:
    """The device this worker computes on: its CUDA device (set by start_process_group), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def start_process_group(world_of_one: bool = True, bind_device: bool = False,
                        timeout_minutes: float = 30.0) -> torch.device:
    """The one process-group set-up of every run (the engine's and the torch loop's): join the workers of the
    torchrun environment (NCCL on GPUs, gloo on the CPU), pick this worker's device, and return it.
    `world_of_one`: a single process without torchrun starts a group of its own too (megatron-core needs one); the
    torch loop's Hugging Face models need none, and join only when there are several workers. `bind_device`: hand
    NCCL the device up front (the torch loop's FSDP2/DDP collectives then know it from the first call).
    `timeout_minutes`: every collective's timeout (the engine's --distributed-timeout-minutes)."""
    world = world_size_from_env()
    if world_of_one and "RANK" not in os.environ:  # plain `python pretrain_megatron_gpt.py`: a world of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", str(free_port())))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    device = current_device()
    if (world > 1 or world_of_one) and not dist.is_initialized():
        timeout = datetime.timedelta(minutes=timeout_minutes)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=int(os.environ["RANK"]),
                                world_size=world, timeout=timeout, store=_attempt_store(world, timeout),
                                device_id=device if bind_device and device.type == "cuda" else None)
    return device


def _attempt_store(world: int, timeout: datetime.timedelta):
    """None (torch's env:// rendezvous) for a first attempt; for torchrun's k-th restart, the rendezvous store under
    the prefix attemptk: the store may outlive a failed attempt (torchrun's agent hosts it), and gloo's full-mesh
    connect would otherwise read the dead attempt's addresses ("Gloo connectFullMesh failed")."""
    attempt = restart_count()
    if attempt == 0 or world == 1:
        return None
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=int(os.environ["RANK"]) == 0 and not agent_store, timeout=timeout)
    return dist.PrefixStore(f"attempt{attempt}", store)


def initialize(cfg: Config) -> Config:
    """Validate `cfg` for this world size (unless the entry point's validate() already did), then start process
    groups and seed every RNG. Returns the validated Config."""
    compat.quiet_known_noise()  # (a no-op where the entry point already did it)
    world = world_size_from_env()
    if not (cfg.checked and cfg.world_size == world):  # the entry point's validate() is not repeated
        cfg = cfg.validate(world)  # before any process group exists: config errors surface cleanly
    compat.check_versions()  # once per process, before any workaround is applied
    if torch.cuda.is_available():
        compat.apply_gpu_fixes()
    else:
        compat.apply_cpu_backend()
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    start_process_group(timeout_minutes=cfg.distributed_timeout_minutes)
    if start_watchdog(cfg.heartbeat_timeout_seconds, cfg.step_timeout_minutes * 60 if cfg.step_timeout_minutes else None):
        print_rank_0(_fault_tolerance(cfg))
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


def _fault_tolerance(cfg: Config) -> str:
    """One line: what ends a hung or dead worker's job, and how often torchrun restarts it."""
    restarts = max_restarts()
    step = (f", a step longer than {cfg.step_timeout_minutes:g} min (--step-timeout-minutes)"
            if cfg.step_timeout_minutes else "")
    return (f"fault tolerance: the job ends when a worker sends no heartbeat for {cfg.heartbeat_timeout_seconds:g} s "
            f"(--heartbeat-timeout-seconds){step} or a collective waits {cfg.distributed_timeout_minutes:g} min "
            f"(--distributed-timeout-minutes); torchrun restarts it up to {restarts} time(s) (MAX_RESTARTS, "
            f"--max-restarts){', resuming from --save' if restarts and cfg.save else ''}")


def destroy() -> None:
    from megatron.core import parallel_state as mpu

    stop_watchdog()
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def is_last_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1


def print_rank_0(*args, **kwargs) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)
