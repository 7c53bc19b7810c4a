"""The learning-rate schedule of the `rapidformer` flags: warmup (--lr-warmup-iters or --lr-warmup-fraction),
then --lr-decay-style constant|linear|cosine from --lr down to --min-lr over --lr-decay-iters (default: the
rest of training)."""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Dict

import torch


def lr_factor(step: int, peak: float, min_lr: float, warmup: int, decay_steps: int, style: str) -> float:
    """The multiplier of the peak learning rate at optimizer step `step` (0-based)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if style == "constant" or peak == 0:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, decay_steps - warmup))
    floor = min_lr / peak
    if style == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class Schedule:
    """A schedule counted in optimizer steps: `factor(step)` multiplies each param group's peak lr."""
    lr: float
    min_lr: float
    warmup: int
    decay: int
    style: str

    def factor(self, step: int) -> float:
        return lr_factor(step, self.lr, self.min_lr, self.warmup, self.decay, self.style)

    @classmethod
    def from_settings(cls, settings: Dict, global_batch_size: int) -> "Schedule":
        """The schedule of the settings a checkpoint stores (config/resume.py's `scheduler_settings`: warmup and
        decay in samples, the iterations times `global_batch_size`, the global batch of the run that wrote them)."""
        return cls(float(settings["max_lr"]), float(settings["min_lr"]),
                   settings["lr_warmup_steps"] // global_batch_size, settings["lr_decay_steps"] // global_batch_size,
                   settings["lr_decay_style"])


def scheduler_for(schedule: Schedule, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR following `schedule` (a plain function as its lambda: its state_dict then holds no schedule
    settings, so loading a checkpoint's state never changes the schedule)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: schedule.factor(step))


def build_scheduler(args: argparse.Namespace, optimizer: torch.optim.Optimizer, total_steps: int):
    """A LambdaLR following the flags, for `total_steps` optimizer steps."""
    if args.lr_warmup_iters is not None:
        warmup = args.lr_warmup_iters
    else:
        warmup = int(round((args.lr_warmup_fraction or 0.0) * total_steps))
    decay = args.lr_decay_iters or total_steps
    return scheduler_for(Schedule(args.lr, args.min_lr, warmup, decay, args.lr_decay_style), optimizer)
