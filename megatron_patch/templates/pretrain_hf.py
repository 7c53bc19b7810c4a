"""The PreTrainer with a Hugging Face (or any PyTorch) model: data parallel, the fine-tuning accelerations,
--train-iters iterations of --global-batch-size samples (gradient accumulation from the batch sizes),
evaluation every --eval-interval, checkpoints every --save-interval with exact resume from --load.

Batches come in Megatron's pretraining order (`PretrainingBatchSampler`: global batch k is samples
[k*gbs, (k+1)*gbs), each worker its slice), so a resumed run reads exactly the samples the whole run would.
"""
from __future__ import annotations

import json
import math
import os
import random
import time
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist

from .globals import get_logger

CHECKPOINT_MARKER = "latest_iteration.txt"


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
            self._queue.append({k: (v[idx][:, :width] if v.dim() >= 2 and v.shape[1] == full else v[idx])
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


# ---- checkpoints ----------------------------------------------------------------------------------------------
def _rng_state() -> Dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: Dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _is_zero_redundancy(optimizer) -> bool:
    return type(optimizer).__name__ == "ZeroRedundancyOptimizer"


def save_checkpoint(path: str, iteration: int, model, optimizer, scheduler, precision) -> None:
    """`path/iter_NNNNNNN/`: model and optimizer through torch.distributed.checkpoint (FSDP shards included;
    ZeroRedundancyOptimizer shards one file per rank), and per rank the RNG, schedule and loss-scaler state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from .saving import unwrap

    rank, world = _world()
    folder = os.path.join(path, f"iter_{iteration:07d}")
    os.makedirs(folder, exist_ok=True)
    inner = unwrap(model)
    zero = _is_zero_redundancy(optimizer)
    model_sd, optim_sd = get_state_dict(inner, [] if zero else [optimizer])
    dcp.save({"model": model_sd, **({} if zero else {"optimizer": optim_sd})}, checkpoint_id=os.path.join(folder, "dcp"))
    local = {"rng": _rng_state(), "scheduler": scheduler.state_dict(), "world_size": world,
             "scaler": precision.scaler.state_dict() if precision.scaler is not None else None}
    if zero:
        local["optimizer_shard"] = optimizer.optim.state_dict()
    torch.save(local, os.path.join(folder, f"rank_{rank:05d}.pt"))
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        with open(os.path.join(path, CHECKPOINT_MARKER), "w") as f:
            f.write(str(iteration))


def load_checkpoint(path: str, model, optimizer, scheduler, precision) -> int:
    """Restore a checkpoint of save_checkpoint(); returns its iteration."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from .saving import unwrap

    rank, world = _world()
    with open(os.path.join(path, CHECKPOINT_MARKER)) as f:
        iteration = int(f.read().strip())
    folder = os.path.join(path, f"iter_{iteration:07d}")
    local = torch.load(os.path.join(folder, f"rank_{rank:05d}.pt"), weights_only=False)
    if local["world_size"] != world:
        raise ValueError(f"--load {path}: saved by {local['world_size']} workers, resumed by {world}; resume with "
                         f"--nproc-per-node {local['world_size']} (this checkpoint resumes exactly only as it was run)")
    inner = unwrap(model)
    zero = _is_zero_redundancy(optimizer)
    model_sd, optim_sd = get_state_dict(inner, [] if zero else [optimizer])
    state = {"model": model_sd, **({} if zero else {"optimizer": optim_sd})}
    dcp.load(state, checkpoint_id=os.path.join(folder, "dcp"))
    if zero:
        set_state_dict(inner, [], model_state_dict=state["model"], optim_state_dict={})
        optimizer.optim.load_state_dict(local["optimizer_shard"])
    else:
        set_state_dict(inner, [optimizer], model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    scheduler.load_state_dict(local["scheduler"])
    # LambdaLR's load_state_dict does not touch the optimizer, and ZeroRedundancyOptimizer copies its own
    # param_groups' lr into the local shard's at each step: set the resumed rate where both read it
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr()):
        group["lr"] = lr
    if precision.scaler is not None and local["scaler"] is not None:
        precision.scaler.load_state_dict(local["scaler"])
    _set_rng_state(local["rng"])
    return iteration


def is_checkpoint(path: Optional[str]) -> bool:
    return bool(path) and os.path.isfile(os.path.join(path, CHECKPOINT_MARKER))


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

    from .finetuner import no_sync
    from .schedule import build_scheduler

    args, log = pretrainer.args, get_logger()
    check_not_parallel(cfg)
    train_ds, valid_ds, _test_ds = datasets
    device = pretrainer.device
    if not is_checkpoint(args.load) and args.load and args.load != args.pretrained_model_name_or_path:
        raise ValueError(f"--load {args.load}: no {CHECKPOINT_MARKER} there; give a --save directory of an earlier "
                         "run to resume, or drop --load")
    acc = accelerate(model.to(device), args, device, optimizer)
    for line in acc.applied:
        log.info(f"acceleration: {line}")
    model, optimizer, precision = acc.model, acc.optimizer, acc.precision
    pretrainer.engine.precision = precision
    if scheduler is not None and getattr(scheduler, "optimizer", None) is not optimizer:
        log.warning("the lr scheduler from model_optimizer_lr_scheduler_provider() drives the optimizer as it was "
                    "before the acceleration switches rebuilt it: using --lr-decay-style instead")
        scheduler = None
    if scheduler is None:
        scheduler = build_scheduler(args, optimizer, cfg.train_iters)
    rank, world = _world()
    accum = cfg.num_microbatches
    start = 0
    if is_checkpoint(args.load):
        start = load_checkpoint(args.load, model, optimizer, scheduler, precision)
        log.info(f"resumed from {args.load} at iteration {start}")
    log.info(f"training: {cfg.train_iters} iterations of {cfg.global_batch_size} samples ({cfg.micro_batch_size} per "
             f"worker x {world} worker(s) x {accum} accumulation): {cfg.train_iters * cfg.global_batch_size} of the "
             f"training dataset's {len(train_ds)} samples")
    # the engine's iterators: Megatron's batch order over data-parallel ranks (here every worker), from `consumed`
    train_iter = build_iterator(train_ds, cfg, start * cfg.global_batch_size, cycle=False)
    valid_iter = build_iterator(valid_ds, cfg, 0, cycle=True) if cfg.eval_iters > 0 else None
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
            tick = time.perf_counter()
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            save_checkpoint(args.save, iteration, model, optimizer, scheduler, precision)
            log.info(f"saved checkpoint iteration {iteration} to {args.save}")
            tick = time.perf_counter()
    if args.save and (not args.save_interval or cfg.train_iters % args.save_interval):
        save_checkpoint(args.save, cfg.train_iters, model, optimizer, scheduler, precision)
        log.info(f"saved checkpoint iteration {cfg.train_iters} to {args.save}")
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
