"""RapidformerEngine: the process group, the device, the seed, and `compose()` for users' own loops."""
from __future__ import annotations

import argparse
import random
from typing import Callable, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from megatron_patch.parallel import start_process_group

from .globals import get_args, get_logger
from .schedule import build_scheduler


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class RapidformerEngine:
    """Sets up a run from the `rapidformer` flags: joins the workers' process group (NCCL on GPUs, gloo on
    the CPU), picks this worker's device and seeds every generator with --seed.

    `compose(model_obj, optimizer=None, lr_scheduler_fn=None)` applies the acceleration switches to a
    model for a loop the user keeps (the how-to's custom-Trainer section)."""

    def __init__(self, args: Optional[argparse.Namespace] = None) -> None:
        self.args = args if args is not None else get_args()
        # the engine's set-up; a single worker starts no group (a Hugging Face model needs none)
        self.device = start_process_group(world_of_one=False, bind_device=True)
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        set_seed(self.args.seed)
        self.precision = None  # set by compose()/the templates: autocast and loss scaling

    def compose(self, model_obj: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None,
                lr_scheduler_fn: Optional[Callable] = None) -> Tuple[torch.nn.Module, torch.optim.Optimizer, object]:
        """Accelerate `model_obj` for the caller's own loop: returns (model, optimizer, lr_scheduler).

        The optimizer is built from --optimizers when not given (apex's fused Adam/LAMB when installed);
        `lr_scheduler_fn(optimizer)` builds the scheduler (e.g. a `partial` of transformers'
        get_linear_schedule_with_warmup); without it, --lr-decay-style over --train-iters. Mixed precision
        needs the loop's help: see the log line, and use `engine.precision.autocast()`/`.backward(loss)`/`.step()`."""
        from .torch_loop import accelerate_for_loop

        log = get_logger()
        acc, _ = accelerate_for_loop(model_obj, optimizer, None, self.args, self.device, log)
        self.precision = acc.precision
        if self.args.mixed_precision or self.args.bf16:
            log.info("compose(): mixed precision needs your loop's help: run the forward pass inside "
                     "`with engine.precision.autocast():`, call `engine.precision.backward(loss)` instead of "
                     "loss.backward(), and `engine.precision.step(optimizer, model, args.clip_grad)` instead of "
                     "optimizer.step() (it unscales, clips and skips steps with inf/nan gradients under fp16)"
                     + ("; with --onnx-runtime-training the first forward must already run inside autocast: ONNX "
                        "Runtime records the precision into the graph it exports then" if
                        getattr(self.args, "onnx_runtime_training", False) else ""))
        from megatron_patch.accelerations import uses_cuda_graphs

        if uses_cuda_graphs(self.args) and self.device.type == "cuda":
            log.info(f"compose(): --torch-compile-mode {self.args.torch_compile_mode} replays CUDA graphs: call "
                     "`megatron_patch.accelerations.mark_step()` before each forward, `.clone()` any output you "
                     "keep past the next step (its memory is reused), and pad batches to a few lengths "
                     "(each new shape records a new graph)")
        if getattr(self.args, "padding_free", False):
            log.info("compose(): --padding-free: the model also takes packed rows; give your training loader "
                     "megatron_patch.data.flatten.FlattenCollator(your_padding_collate, multiple, "
                     "model.config.max_position_embeddings) and evaluate on padded batches")
        if lr_scheduler_fn is not None:
            scheduler = lr_scheduler_fn(acc.optimizer)
        else:
            scheduler = build_scheduler(self.args, acc.optimizer, total_steps=self.args.train_iters or 1)
        return acc.model, acc.optimizer, scheduler
