"""What a run tells its user: one log line per --log-interval, TensorBoard scalars, one JSON line per
record in --metrics-file, and a progress bar when stderr is a terminal.

`RunOutputs` and `progress_bar` are the outputs both training loops write to: the engine's `Reporter` here and the
torch loop's `LoopReporter` (templates/reporting.py), which differ only in what their lines say."""
from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from megatron_patch.config import Config
from megatron_patch.parallel import print_rank_0

from .metrics import flops_per_token, peak_tflops


class RunOutputs:
    """TensorBoard scalars under `tensorboard_dir` (written where `scalars_here`: the rank that has the numbers)
    and one JSON line per record in `metrics_file` (where `records_here`: rank 0); None turns either off."""

    def __init__(self, tensorboard_dir: Optional[str], metrics_file: Optional[str], scalars_here: bool,
                 records_here: bool) -> None:
        self.writer = None
        if tensorboard_dir and scalars_here:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(tensorboard_dir)
        self.metrics_file = metrics_file if records_here else None
        if self.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(self.metrics_file)), exist_ok=True)

    def scalar(self, tag: str, value: float, step: int) -> None:
        if self.writer:
            self.writer.add_scalar(tag, value, step)

    def record(self, record: Dict[str, Any]) -> None:
        if self.metrics_file:
            with open(self.metrics_file, "a") as f:
                f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self.writer:
            self.writer.close()
            self.writer = None


def progress_bar(total: int, desc: str, unit: str, initial: int = 0, show: bool = True):
    """A tqdm bar on stderr when `show` (rank 0) and stderr is a terminal, else None: a log file gets the
    --log-interval lines only."""
    if not show or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True,
                mininterval=1.0, leave=False)


class Reporter:
    """Owns the run's outputs; `train()` hands it each iteration's metrics."""

    def __init__(self, cfg: Config, num_params: int, start_iteration: int) -> None:
        self.cfg, self.num_params = cfg, num_params
        rank = dist.get_rank()
        # the last pipeline stage has the loss: its last rank writes the scalars
        self.outputs = RunOutputs(cfg.tensorboard_dir, cfg.metrics_file, rank == dist.get_world_size() - 1, rank == 0)
        self.bar = progress_bar(cfg.train_iters, "training", "it", start_iteration, show=rank == 0)

    def record(self, metrics: Dict[str, float]) -> None:
        """One JSON line in --metrics-file (rank 0)."""
        self.outputs.record(metrics)

    def step(self, metrics: Dict[str, float]) -> None:
        self.record(metrics)
        if self.bar:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{metrics['loss']:.3f}")

    def log(self, metrics: Dict[str, float], seconds: float, iters: int) -> None:
        """The --log-interval line: averages over the `iters` iterations that took `seconds`."""
        cfg, it = self.cfg, metrics["iteration"]
        tps = cfg.global_batch_size * cfg.seq_length * iters / seconds
        tflops = tps * flops_per_token(self.num_params, cfg.num_layers, cfg.hidden_size, cfg.seq_length) / 1e12
        per_gpu = tflops / dist.get_world_size()
        peak = peak_tflops()
        mem = f" | mem {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if torch.cuda.is_available() else ""
        mfu = f" | MFU {100 * per_gpu / peak:.1f}%" if peak else ""
        parts = _components(metrics)  # BERT: the masked-LM and next-sentence ("sop") losses that make up `loss`
        losses = "".join(f" | {k} {v:.4f}" for k, v in parts.items())
        line = (f"iteration {it:>6}/{cfg.train_iters} | loss {metrics['loss']:.4f}{losses} | lr {metrics['lr']:.3e} | "
                f"grad norm {metrics['grad_norm']:.3f} | loss scale {metrics['loss_scale']:g} | "
                f"{1000 * seconds / iters:.0f} ms/iter | tokens/s {tps:,.0f} | TFLOP/s/GPU {per_gpu:.1f}{mfu}{mem}")
        moe = {k: v for k, v in metrics.items() if k.startswith("moe_") and isinstance(v, float)}
        line += "".join(f" | {k[4:].replace('_', ' ')} {v:.4f}" for k, v in moe.items())
        if metrics["skipped"]:
            line += " | step skipped (inf/nan grads, loss scale lowered)"
        print_rank_0(line)
        scalars = {**(parts or {"lm loss": metrics["loss"]}), "learning-rate": metrics["lr"],
                   "grad-norm": metrics["grad_norm"], "loss-scale": metrics["loss_scale"], "tokens-per-sec": tps,
                   "tflops-per-gpu": per_gpu}
        for k, v in scalars.items():
            self.outputs.scalar(k, v, it)
        for k, v in moe.items():
            self.outputs.scalar(k.replace("moe_", "moe/", 1), v, it)

    def validation(self, iteration: int, loss: float, test_loss: Optional[float] = None,
                   components: Optional[Dict[str, float]] = None) -> None:
        """`components`: the losses that make up `loss` when there are several (BERT: lm_loss, sop_loss)."""
        record = {"iteration": iteration, "valid_loss": loss}
        parts = _components(components or {})
        if parts:
            lm = parts.get("lm loss", loss)
            text = (f"validation at iteration {iteration} | loss {loss:.6f}"
                    + "".join(f" | {k} {v:.6f}" for k, v in parts.items()) + f" | lm ppl {math.exp(min(lm, 50)):.2f}")
            record.update({f"valid_{k}": v for k, v in (components or {}).items()})
        else:
            text = f"validation at iteration {iteration} | lm loss {loss:.6f} | ppl {math.exp(min(loss, 50)):.2f}"
        if test_loss is not None:
            record["test_loss"] = test_loss
            text += f" | test {'' if parts else 'lm '}loss {test_loss:.6f}"
        self.record(record)
        print_rank_0(text)
        for k, v in (parts or {"lm loss": loss}).items():
            self.outputs.scalar(f"validation {k}", v, iteration)

    def close(self) -> None:
        if self.bar:
            self.bar.close()
        self.outputs.close()


LOSS_COMPONENTS = ("lm_loss", "sop_loss")  # BERT: masked LM, next sentence (Megatron-LM calls it "sop loss")


def _components(metrics: Dict[str, float]) -> Dict[str, float]:
    """The loss components in `metrics`, by their log names ("lm loss", "sop loss"); {} when there are none."""
    return {k.replace("_", " "): metrics[k] for k in LOSS_COMPONENTS if k in metrics}
