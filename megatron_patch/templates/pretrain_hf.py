"""The PreTrainer with a Hugging Face (or any PyTorch) model: data parallel, the fine-tuning accelerations,
--train-iters iterations of --global-batch-size samples (gradient accumulation from the batch sizes),
evaluation every --eval-interval, checkpoints every --save-interval with exact resume from --load (the layout
and its guarantees: `checkpoint_hf.py`; the learning-rate schedule a resume continues: `resume_hf.py`).

Batches come in Megatron's pretraining order (`PretrainingBatchSampler`: global batch k is samples
[k*gbs, (k+1)*gbs), each worker its slice), so a resumed run reads exactly the samples the whole run would.
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Dict, List

import torch
import torch.distributed as dist

from megatron_patch.config.checkpoint_layout import TRACKER, CheckpointError

from .checkpoint_hf import find_checkpoint, load_checkpoint, save_checkpoint
from .globals import get_logger


def _world() -> tuple:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class DynamicShape:
    """`--data-iterator dynamic-shape`: the samples of one optimizer step (this worker's share of a global batch:
    the same samples as fixed-shape) are bucketed by length with the C++ helper (`packing.bucket_by_length`)
    into micro batches of at most --micro-batch-size x --seq-length tokens after padding, each cut to its
    longest sample rounded up to `multiple`: short samples travel many to a micro batch, long ones few. Padding is
    masked out of attention and of the loss, so every sample's loss is the one fixed-shape gives; each micro
    batch's loss is weighted by its share of the step's samples. Every worker runs the same number of micro
    batches (FSDP gathers parameters per forward): a worker with fewer splits its largest.

    The loop calls `next_step()` -> number of micro batches (and `weights`), then draws that many batches."""

    def __init__(self, base, accum: int, micro_batch_size: int, seq_length: int, multiple: int = 64) -> None:
        self.base, self.accum, self.seq_length, self.multiple = base, accum, seq_length, multiple
        self.budget = micro_batch_size * seq_length
        self.real = self.computed = self.fixed = 0
        self.weights: List[float] = []
        self._queue: List[Dict] = []

    def __iter__(self):
        return self

    def __next__(self) -> Dict:
        if not self._queue:
            raise RuntimeError("dynamic-shape: run_forward_step drew more micro batches than this step has; draw one "
                               "batch per call")
        return self._queue.pop(0)

    def next_step(self) -> int:
        from megatron_patch.data.packing import bucket_by_length

        batches = [next(self.base) for _ in range(self.accum)]
        if "attention_mask" not in batches[0]:
            raise ValueError("--data-iterator dynamic-shape cuts the padding of samples with an attention_mask "
                             "(BERT-style sentence pairs); these samples have none (GPT samples are packed to "
                             "--seq-length and carry no padding): drop the flag")
        merged = {k: torch.cat([torch.as_tensor(b[k]) for b in batches]) for k in batches[0]}
        lengths = merged["attention_mask"].sum(dim=1)
        groups = bucket_by_length(lengths.numpy(), self.budget, self.multiple)
        groups = _equalize(groups)
        total, full = len(lengths), merged["attention_mask"].shape[1]
        self._queue, self.weights = [], []
        for idx in groups:
            idx = torch.as_tensor(idx)
            width = min(self.seq_length, int(-(-int(lengths[idx].max()) // self.multiple) * self.multiple))
            # contiguous: a width slice of [samples, full] is a strided view, and models call .view() on their
            # inputs (transformers' BERT: labels.view(-1))
            self._queue.append({k: (v[idx][:, :width].contiguous() if v.dim() >= 2 and v.shape[1] == full else v[idx])
                                for k, v in merged.items()})
            self.weights.append(len(idx) / total)
            self.real += int(lengths[idx].sum())
            self.computed += len(idx) * width
        self.fixed += total * full
        return len(groups)

    def describe(self) -> str:
        pad = 1 - self.real / self.computed if self.computed else 0.0
        fixed = 1 - self.real / self.fixed if self.fixed else 0.0
        return (f"dynamic-shape: padding {pad:.1%} of computed tokens (fixed-shape: {fixed:.1%}); "
                f"{self.computed:,} tokens computed instead of {self.fixed:,}")


def _equalize(groups: List) -> List:
    """The same number of micro batches on every worker: split the largest group until all have the maximum."""
    count = torch.tensor([len(groups)], dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_backend() == "nccl":
            count = count.cuda()
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
    groups = list(groups)
    while len(groups) < int(count.item()):
        big = max(range(len(groups)), key=lambda i: len(groups[i]))
        if len(groups[big]) < 2:
            break  # nothing left to split: every worker then still draws its own count (cannot happen with
            # equal micro batch sizes, since the maximum count is at most the step's samples)
        g = groups.pop(big)
        groups[big:big] = [g[: len(g) // 2], g[len(g) // 2:]]
    return groups


def check_not_parallel(cfg) -> None:
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    if tp > 1 or pp > 1:
        from megatron_patch.config import ConfigError

        raise ConfigError(f"--tensor-model-parallel-size {tp} --pipeline-model-parallel-size {pp}: tensor and pipeline "
                          "parallelism are for Megatron models (the guide), and model_optimizer_lr_scheduler_provider() "
                          "returned a Hugging Face/PyTorch model. Drop the two flags (data parallelism and "
                          "--zero-*/--fsdp-memory-optimization shard a Hugging Face model), or build a Megatron model, "
                          "e.g. megatron_patch.models.GPTModel()")


# ---- the loop --------------------------------------------------------------------------------------------------
class _Log:
    """One line per --log-interval iterations, TensorBoard scalars and --metrics-file JSON lines, on rank 0."""

    def __init__(self, args, rank: int) -> None:
        self.args, self.rank, self.log = args, rank, get_logger()
        self.writer = None
        if rank == 0 and args.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(args.tensorboard_dir)
        if rank == 0 and args.metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(args.metrics_file)), exist_ok=True)

    def write(self, record: Dict) -> None:
        if self.rank != 0:
            return
        if self.writer:
            for k, v in record.items():
                if k != "iteration" and isinstance(v, float) and math.isfinite(v):
                    self.writer.add_scalar(f"{record.get('split', 'train')}/{k}", v, record["iteration"])
        if self.args.metrics_file:
            with open(self.args.metrics_file, "a") as f:
                f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self.writer:
            self.writer.close()


def _mean(value: torch.Tensor) -> float:
    value = value.detach().float().clone()
    if dist.is_initialized():
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value.item()


def run(pretrainer, cfg, datasets, model, optimizer, scheduler) -> List[Dict]:
    """Pretrain a Hugging Face/PyTorch `model` on `datasets` for cfg.train_iters iterations."""
    from megatron_patch.accelerations import accelerate
    from megatron_patch.training.data import build_iterator

    from . import resume_hf
    from .finetuner import no_sync
    from .schedule import scheduler_for

    args, log = pretrainer.args, get_logger()
    check_not_parallel(cfg)
    train_ds, valid_ds, _test_ds = datasets
    device = pretrainer.device
    resume = None
    if args.load:
        resume, warnings = find_checkpoint(args.load)  # before the model is built: a bad --load fails at once
        for line in warnings:
            log.info(line)
        if resume is None and args.load != args.pretrained_model_name_or_path:
            raise CheckpointError(f"--load {args.load}: no checkpoint there (no {TRACKER}, no iter_XXXXXXX "
                                  "directory); give the --save directory of an earlier run to resume, or drop --load")
    acc = accelerate(model.to(device), args, device, optimizer)
    for line in acc.applied:
        log.info(f"acceleration: {line}")
    model, optimizer, precision = acc.model, acc.optimizer, acc.precision
    pretrainer.engine.precision = precision
    if scheduler is not None and getattr(scheduler, "optimizer", None) is not optimizer:
        log.warning("the lr scheduler from model_optimizer_lr_scheduler_provider() drives the optimizer as it was "
                    "before the acceleration switches rebuilt it: using --lr-decay-style instead")
        scheduler = None
    # the schedule: this run's flags, or the checkpoint's (refused here when they differ without a choice)
    plan = resume_hf.plan(cfg, args.load, resume, own_scheduler=scheduler is not None)
    if scheduler is None:
        scheduler = scheduler_for(plan.schedule, optimizer)
    rank, world = _world()
    accum = cfg.num_microbatches
    start = consumed = consumed_valid = 0
    if resume is not None:
        built = resume_hf.group_settings(optimizer)  # this run's peak lr and weight decay, before loading
        state = load_checkpoint(args.load, resume, model, optimizer, scheduler, precision)
        start, consumed, consumed_valid = state["iteration"], state["consumed_samples"], state["consumed_valid_samples"]
        if plan.schedule is not None:
            if plan.from_checkpoint:
                peaks, decays = scheduler.base_lrs, state["weight_decay"] or [None] * len(built)
            else:
                peaks, decays = [p for p, _ in built], [d for _, d in built]
            resume_hf.continue_schedule(scheduler, optimizer, peaks, decays)
        notes = state["notes"] + ([plan.note] if plan.note else [])
        log.info(f"resumed from {args.load} at iteration {start} ({consumed} training and {consumed_valid} validation "
                 "samples read)" + "".join(f"; {note}" for note in notes))
    log.info(f"training: {cfg.train_iters} iterations of {cfg.global_batch_size} samples ({cfg.micro_batch_size} per "
             f"worker x {world} worker(s) x {accum} accumulation): {cfg.train_iters * cfg.global_batch_size} of the "
             f"training dataset's {len(train_ds)} samples")
    # the engine's iterators: Megatron's batch order over data-parallel ranks (here every worker), from `consumed`
    train_iter = build_iterator(train_ds, cfg, consumed, cycle=False)
    # validation walks on through its set from where the checkpoint left it, as the uninterrupted run does
    valid_iter = build_iterator(valid_ds, cfg, consumed_valid, cycle=True) if cfg.eval_iters > 0 else None
    dynamic = args.data_iterator == "dynamic-shape"
    if dynamic:  # training only: validation batches stay fixed-shape, so their losses compare across runs
        # widths rounded to 64 tokens (--pad-to-multiple-of): each new batch shape costs the GPU a slow first
        # step (measured: ~100 vs ~400 samples/s on BERT-base), so few distinct widths pay
        train_iter = DynamicShape(train_iter, accum, cfg.micro_batch_size, cfg.seq_length,
                                  args.pad_to_multiple_of or 64)
    reporter = _Log(args, rank)
    history: List[Dict] = []
    loss_sum, tick, since = torch.zeros((), device=device), time.perf_counter(), 0
    model.train()
    for iteration in range(start + 1, cfg.train_iters + 1):
        micro_batches = train_iter.next_step() if dynamic else accum
        weights = train_iter.weights if dynamic else [1.0 / accum] * accum
        for micro in range(micro_batches):
            with no_sync(model, micro == micro_batches - 1):
                with precision.autocast():
                    loss = pretrainer.run_forward_step(train_iter, model)
                precision.backward(loss * weights[micro])
            loss_sum += loss.detach().float() * weights[micro]
        grad_norm, skipped = precision.step(optimizer, model, cfg.clip_grad)
        optimizer.zero_grad(set_to_none=True)
        lr = optimizer.param_groups[0]["lr"]
        if not skipped:
            scheduler.step()
        since += 1
        consumed += cfg.global_batch_size
        record = {"iteration": iteration, "loss": _mean(loss_sum), "lr": lr,
                  "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"), "skipped": bool(skipped)}
        loss_sum = torch.zeros((), device=device)
        history.append(record)
        if iteration % cfg.log_interval == 0 or iteration == cfg.train_iters:
            elapsed = time.perf_counter() - tick
            log.info(f"iteration {iteration}/{cfg.train_iters} | loss {record['loss']:.4f} | lr {lr:.3e} | grad norm "
                     f"{record['grad_norm']:.3f} | {since * cfg.global_batch_size / elapsed:.1f} samples/s"
                     + (" | step skipped (inf/nan gradients)" if skipped else "")
                     + (f" | {train_iter.describe()}" if dynamic and iteration == cfg.train_iters else ""))
            extra = {"samples_per_s": since * cfg.global_batch_size / elapsed}
            if torch.cuda.is_available():
                extra["max_memory_bytes"] = torch.cuda.max_memory_allocated()
            if dynamic:
                extra.update(real_tokens=train_iter.real, computed_tokens=train_iter.computed,
                             fixed_tokens=train_iter.fixed)
            reporter.write({**record, **extra})
            tick, since = time.perf_counter(), 0
        if valid_iter is not None and cfg.eval_interval and iteration % cfg.eval_interval == 0:
            _validate(pretrainer, model, precision, valid_iter, cfg, iteration, reporter, history)
            consumed_valid += cfg.eval_iters * cfg.global_batch_size  # what _validate read over all workers
            tick = time.perf_counter()
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            saved = save_checkpoint(args.save, iteration, model, optimizer, scheduler, precision, consumed,
                                    consumed_valid, plan.manifest_entries(cfg))
            log.info(f"saved checkpoint {saved}")
            tick = time.perf_counter()
    if args.save and (not args.save_interval or cfg.train_iters % args.save_interval) and start < cfg.train_iters:
        saved = save_checkpoint(args.save, cfg.train_iters, model, optimizer, scheduler, precision, consumed,
                                consumed_valid, plan.manifest_entries(cfg))
        log.info(f"saved checkpoint {saved}")
    reporter.close()
    pretrainer.model = model
    return history


def _validate(pretrainer, model, precision, valid_iter, cfg, iteration, reporter, history) -> None:
    model.eval()
    total = 0.0
    with torch.no_grad(), precision.autocast():
        for _ in range(cfg.eval_iters * cfg.num_microbatches):
            total += _mean(pretrainer.run_forward_step(valid_iter, model))
    model.train()
    loss = total / (cfg.eval_iters * cfg.num_microbatches)
    get_logger().info(f"validation at iteration {iteration} | loss {loss:.4f} (mean of {cfg.eval_iters} batches)")
    record = {"iteration": iteration, "split": "validation", "loss": loss}
    reporter.write(record)
    history.append(record)
