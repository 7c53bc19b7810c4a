"""The learning-rate schedule of the `rapidformer` flags: warmup (--lr-warmup-iters or --lr-warmup-fraction),
then --lr-decay-style constant|linear|cosine from --lr down to --min-lr over --lr-decay-iters (default: the
rest of training)."""
from __future__ import annotations

import argparse
import math

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


def build_scheduler(args: argparse.Namespace, optimizer: torch.optim.Optimizer, total_steps: int):
    """A LambdaLR following the flags, for `total_steps` optimizer steps."""
    if args.lr_warmup_iters is not None:
        warmup = args.lr_warmup_iters
    else:
        warmup = int(round((args.lr_warmup_fraction or 0.0) * total_steps))
    decay = args.lr_decay_iters or total_steps
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, args.lr, args.min_lr, warmup, decay, args.lr_decay_style))
