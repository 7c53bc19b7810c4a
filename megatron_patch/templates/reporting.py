"""What the torch loop (templates/torch_loop.py) tells its user, on rank 0: a progress bar on a terminal, a line
every --log-interval optimizer steps (the loss averaged over the steps since the last line and over all workers),
one line per evaluation, TensorBoard scalars under --tensorboard-dir and JSON lines in --metrics-file.

A run counts in its own unit: a fine-tuning run in steps of epochs (`step 30/90 | epoch 1 | loss ...`, and per
evaluation `epoch 1 | validation accuracy 0.8730 | ...`), a pretraining run in iterations (`iteration 30/90 |
loss ...`, a JSON line per logged iteration, `validation at iteration 30 | loss ...`)."""
from __future__ import annotations

import contextlib
import math
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_patch.training.reporting import RunOutputs, progress_bar

from .globals import get_logger


def _format(value) -> str:
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 1e5 else f"{value:.4g}"
    return str(value)


def mean_over_workers(value: torch.Tensor) -> float:
    """The mean of `value` over all workers (collective)."""
    value = value.detach().float().clone()
    if dist.is_initialized():
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value.item()


class LoopReporter:
    """`unit` "step" (fine-tuning: epochs) or "iteration" (pretraining); `total` optimizer steps of the run.
    `history` keeps every step's record (loss over all workers, lr, gradient norm) and every validation's."""

    def __init__(self, args, rank: int, total: int, unit: str, epochs: Optional[int] = None) -> None:
        self.args, self.rank, self.total, self.unit, self.epochs = args, rank, total, unit, epochs
        self.log = get_logger()
        self.history: List[Dict] = []
        self.describe_data = None  # a callable giving extra words and record entries (dynamic-shape's padding)
        self._pending: List[tuple] = []  # (record, loss tensor, grad norm) of the steps since the last log line
        self._logged: List[Dict] = []  # the records of the last line's steps
        self._samples = 0
        self._bar = None
        self._tick = time.perf_counter()
        self.outputs = RunOutputs(args.tensorboard_dir, args.metrics_file, rank == 0, rank == 0)

    @contextlib.contextmanager
    def epoch(self, progress, steps: Optional[int]):
        """A progress bar over the epoch's steps on a terminal; a log file gets the --log-interval lines only."""
        left = self.total - progress.iteration
        desc = f"epoch {progress.epoch}/{self.epochs}" if self.epochs else "training"
        self._bar = progress_bar(min(steps, left) if steps else left, desc, self.unit, show=self.rank == 0)
        try:
            yield self._bar
        finally:
            if self._bar is not None:
                self._bar.close()
            self._bar = None

    def restart_clock(self) -> None:
        self._tick = time.perf_counter()

    def train_step(self, progress, result, samples: int) -> None:
        """Record one optimizer step (`samples`: over all workers); a line every --log-interval steps and at the
        last. The step's loss and gradient norm stay on the device until that line, which reads all of them in one
        reduction (a step does not wait for the GPU to report)."""
        step = progress.iteration
        record = {"iteration": step, "loss": None, "lr": result.lr, "grad_norm": None, "skipped": result.skipped}
        self.history.append(record)
        self._pending.append((record, result.loss, result.grad_norm))
        self._samples += samples
        if self._bar is not None:
            self._bar.update(1)
        if step % self.args.log_interval and step != self.total:
            return
        self._materialize()
        elapsed = time.perf_counter() - self._tick
        loss = sum(r["loss"] for r in self._logged) / len(self._logged)
        extra = {"samples_per_s": self._samples / elapsed}
        if torch.cuda.is_available():
            extra["max_memory_bytes"] = torch.cuda.max_memory_allocated()
        words, entries = self.describe_data(step == self.total) if self.describe_data else ("", {})
        extra.update(entries)
        where = (f"step {step}/{self.total} | epoch {progress.epoch}" if self.unit == "step"
                 else f"iteration {step}/{self.total}")
        if self.rank == 0:
            self.log.info(f"{where} | loss {loss:.4f} | lr {result.lr:.3e} | grad norm {record['grad_norm']:.3f} | "
                          f"{extra['samples_per_s']:.1f} samples/s"
                          + (" | step skipped (inf/nan gradients, loss scale lowered)" if result.skipped else "")
                          + words)
            self._scalars("train", dict(record, loss=loss, **extra), step)
            if self.unit == "iteration":  # a fine-tuning run's --metrics-file holds its evaluations only
                self._write(dict(record, loss=loss, **extra))
        self._samples = 0
        self.restart_clock()

    def _materialize(self) -> None:
        """Fill the pending records' loss (the mean over all workers: one collective) and gradient norm (one
        transfer from the device for all); `_logged` keeps them for the line."""
        self._logged = [record for record, _, _ in self._pending]
        if not self._pending:
            return
        losses = torch.stack([loss.detach().float().reshape(()) for _, loss, _ in self._pending])
        if dist.is_initialized():
            dist.all_reduce(losses)
            losses /= dist.get_world_size()
        norms = [n for _, _, n in self._pending]
        tensors = [i for i, n in enumerate(norms) if torch.is_tensor(n)]
        if tensors:  # one transfer for the losses and the tensor norms
            values = torch.cat([losses, torch.stack([norms[i].detach().float().reshape(()).to(losses.device)
                                                     for i in tensors])]).tolist()
            losses, read = values[:len(norms)], values[len(norms):]
            for i, v in zip(tensors, read):
                norms[i] = v
        else:
            losses = losses.tolist()
        for (record, _, _), loss, norm in zip(self._pending, losses, norms):
            record["loss"] = loss
            record["grad_norm"] = float(norm) if norm is not None else float("nan")
        self._pending = []

    def evaluation(self, epoch: int, step: int, split: str, metrics: Dict, in_epoch: bool = False) -> None:
        """One line (and a JSON line, TensorBoard scalars) per evaluation of a fine-tuning run; `in_epoch`: one of
        --eval-interval's, which names its step too."""
        if self.rank != 0 or not metrics:
            return
        values = {k: (float(v) if isinstance(v, (int, float)) or torch.is_tensor(v) else v) for k, v in metrics.items()}
        where = f"epoch {epoch} step {step}" if in_epoch else f"epoch {epoch}"
        self.log.info(f"{where} | " + " | ".join(f"{split} {k} {_format(v)}" for k, v in values.items()))
        self._scalars(split, values, step)
        self._write({"epoch": epoch, "step": step, "split": split, **values})

    def validation_loss(self, iteration: int, loss: float, batches: int) -> None:
        """The validation loss of a pretraining run (averaged over `batches` global batches and all workers)."""
        record = {"iteration": iteration, "split": "validation", "loss": loss}
        self.history.append(record)
        if self.rank != 0:
            return
        self.log.info(f"validation at iteration {iteration} | loss {loss:.4f} (mean of {batches} batches)")
        self._scalars("validation", record, iteration)
        self._write(record)

    def _scalars(self, split: str, values: Dict, step: int) -> None:
        for k, v in values.items():
            if k not in ("iteration", "step", "epoch") and isinstance(v, float) and math.isfinite(v):
                self.outputs.scalar(f"{split}/{k}", v, step)

    def _write(self, record: Dict) -> None:
        self.outputs.record(record)

    def close(self) -> None:
        self._materialize()  # steps after the last line (a stop rule ended the run between two) get their values
        self.outputs.close()
