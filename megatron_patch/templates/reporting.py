"""What a fine-tuning run tells its user: a progress bar, a loss line every --log-interval steps, one line per
evaluation (`epoch N | validation accuracy 0.8730 | ...`), TensorBoard scalars under --tensorboard-dir and
a JSON line per evaluation in --metrics-file. Rank 0 reports; the loss is averaged over all workers."""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from typing import Dict

import torch
import torch.distributed as dist

from .globals import get_logger


def _format(value) -> str:
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 1e5 else f"{value:.4g}"
    return str(value)


class MetricsReporter:
    def __init__(self, args, rank: int) -> None:
        self.args, self.rank = args, rank
        self.log = get_logger()
        self._loss_sum = None
        self._loss_count = 0
        self._samples = 0
        self._tick = time.perf_counter()
        self.writer = None
        if rank == 0 and args.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(args.tensorboard_dir)
        if rank == 0 and args.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(args.metrics_file)), exist_ok=True)

    @contextlib.contextmanager
    def progress(self, total: int, desc: str):
        from tqdm import tqdm

        # a bar on a terminal; a log file gets the --log-interval lines only
        bar = tqdm(total=total, desc=desc, unit="step", disable=self.rank != 0 or not sys.stderr.isatty(), file=sys.stderr,
                   dynamic_ncols=True, mininterval=1.0, leave=False)
        try:
            yield bar
        finally:
            bar.close()

    def add_loss(self, loss: torch.Tensor, batch) -> None:
        # a copy: under CUDA graphs `loss` is a graph output that the next step overwrites
        self._loss_sum = loss.float().clone() if self._loss_sum is None else self._loss_sum + loss.float()
        self._loss_count += 1
        first = next(iter(batch.values())) if hasattr(batch, "values") else batch[0]
        self._samples += int(first.shape[0]) if hasattr(first, "shape") else 0

    def step(self, step: int, total: int, epoch: int, lr: float, grad_norm, skipped: bool) -> None:
        if step % self.args.log_interval and step != total:
            return
        loss = self._loss_sum / max(1, self._loss_count)
        samples = torch.tensor(float(self._samples), device=loss.device)
        if dist.is_initialized():
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
            dist.all_reduce(samples)
        elapsed = time.perf_counter() - self._tick
        grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
        if self.rank == 0:
            self.log.info(f"step {step}/{total} | epoch {epoch} | loss {loss.item():.4f} | lr {lr:.3e} | grad norm "
                          f"{grad_norm:.3f} | {samples.item() / elapsed:.1f} samples/s"
                          + (" | step skipped (inf/nan gradients, loss scale lowered)" if skipped else ""))
            if self.writer:
                self.writer.add_scalar("train/loss", loss.item(), step)
                self.writer.add_scalar("train/lr", lr, step)
                if math.isfinite(grad_norm):
                    self.writer.add_scalar("train/grad_norm", grad_norm, step)
        self._loss_sum, self._loss_count, self._samples = None, 0, 0
        self._tick = time.perf_counter()

    def evaluation(self, epoch: int, step: int, split: str, metrics: Dict, in_epoch: bool = False) -> None:
        """One line (and a JSON line, TensorBoard scalars) per evaluation; `in_epoch`: one of --eval-interval's,
        which names its step too."""
        if self.rank != 0 or not metrics:
            return
        values = {k: (float(v) if isinstance(v, (int, float)) or torch.is_tensor(v) else v) for k, v in metrics.items()}
        where = f"epoch {epoch} step {step}" if in_epoch else f"epoch {epoch}"
        self.log.info(f"{where} | " + " | ".join(f"{split} {k} {_format(v)}" for k, v in values.items()))
        if self.writer:
            for k, v in values.items():
                if isinstance(v, float):
                    self.writer.add_scalar(f"{split}/{k}", v, step)
        if self.args.metrics_file:
            with open(self.args.metrics_file, "a") as f:
                f.write(json.dumps({"epoch": epoch, "step": step, "split": split, **values}) + "\n")

    def close(self) -> None:
        if self.writer:
            self.writer.close()
