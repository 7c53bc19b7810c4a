"""The PreTrainer with a Hugging Face (or any PyTorch) model: data parallel, the fine-tuning accelerations,
--train-iters iterations of --global-batch-size samples (gradient accumulation from the batch sizes),
evaluation every --eval-interval, checkpoints every --save-interval with exact resume from --load, on the torch
loop (`torch_loop.py`; the checkpoint layout and its guarantees: training/checkpoint/torch_dcp.py; the
learning-rate schedule a resume continues: `resume_hf.py`).

Batches come in Megatron's pretraining order (`PretrainingBatchSampler`: global batch k is samples
[k*gbs, (k+1)*gbs), each worker its slice), so a resumed run reads exactly the samples the whole run would.
"""
from __future__ import annotations

from typing import Dict, List

from megatron_patch.config.checkpoint_layout import TRACKER, CheckpointError
from megatron_patch.data.dynamic_shape import StepBuckets

from .globals import get_logger
from .reporting import LoopReporter, mean_over_workers
from .torch_loop import (IteratorBatches, Stop, TorchLoop, TrainState, TrainStep, Validator, accelerate_for_loop,
                         evaluating)


# ---- the run: the torch loop's parts for a pretraining run ----------------------------------------------------
def run(pretrainer, cfg, datasets, model, optimizer, scheduler) -> List[Dict]:
    """Pretrain a Hugging Face/PyTorch `model` on `datasets` for cfg.train_iters iterations on the torch loop
    (templates/torch_loop.py); returns the record of every iteration and validation."""
    from megatron_patch.accelerations import mark_step, uses_cuda_graphs
    from megatron_patch.training.checkpoint.torch_dcp import TorchCheckpointer, find_checkpoint
    from megatron_patch.training.data import build_iterator

    from . import resume_hf
    from .schedule import scheduler_for

    args, log = pretrainer.args, get_logger()
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
    acc, scheduler = accelerate_for_loop(model, optimizer, scheduler, args, device, log)
    model, optimizer, precision = acc.model, acc.optimizer, acc.precision
    pretrainer.engine.precision = precision
    # the schedule: this run's flags, or the checkpoint's (refused here when they differ without a choice)
    plan = resume_hf.plan(cfg, args.load, resume, own_scheduler=scheduler is not None)
    if scheduler is None:
        scheduler = scheduler_for(plan.schedule, optimizer)
    checkpointer = TorchCheckpointer(args.save, args.save_interval, plan.manifest_entries(cfg), log.info)
    checkpointer.attach(model, optimizer, scheduler, precision)
    progress = TrainState()
    if resume is not None:
        built = resume_hf.group_settings(optimizer)  # this run's peak lr and weight decay, before loading
        state = checkpointer.load(args.load, resume)
        progress = TrainState(state["iteration"], state["consumed_samples"], state["consumed_valid_samples"])
        if plan.schedule is not None:
            if plan.from_checkpoint:
                peaks, decays = scheduler.base_lrs, state["weight_decay"] or [None] * len(built)
            else:
                peaks, decays = [p for p, _ in built], [d for _, d in built]
            resume_hf.continue_schedule(scheduler, optimizer, peaks, decays)
        notes = state["notes"] + ([plan.note] if plan.note else [])
        log.info(f"resumed from {args.load} at iteration {progress.iteration} ({progress.consumed_samples} training "
                 f"and {progress.consumed_valid_samples} validation samples read)" + "".join(f"; {n}" for n in notes))
    world = pretrainer.engine.world_size
    accum = cfg.num_microbatches
    log.info(f"training: {cfg.train_iters} iterations of {cfg.global_batch_size} samples ({cfg.micro_batch_size} per "
             f"worker x {world} worker(s) x {accum} accumulation): {cfg.train_iters * cfg.global_batch_size} of the "
             f"training dataset's {len(train_ds)} samples")
    # the engine's iterators: Megatron's batch order over data-parallel ranks (here every worker), from the position
    readers = (pretrainer.engine.rank, world)  # every worker reads (no tensor or pipeline parallelism)
    train_iter = build_iterator(train_ds, cfg, progress.consumed_samples, cycle=False, data_parallel=readers)
    # validation walks on through its set from where the checkpoint left it, as the uninterrupted run does
    valid_iter = build_iterator(valid_ds, cfg, progress.consumed_valid_samples, cycle=True,
                                data_parallel=readers) if cfg.eval_iters > 0 else None
    dynamic = args.data_iterator == "dynamic-shape"
    if dynamic:  # training only: validation batches stay fixed-shape, so their losses compare across runs
        # widths rounded to 64 tokens (--pad-to-multiple-of): each new batch shape costs the GPU a slow first
        # step (measured: ~100 vs ~400 samples/s on BERT-base), so few distinct widths pay
        train_iter = StepBuckets(train_iter, accum, cfg.micro_batch_size, cfg.seq_length,
                                 args.pad_to_multiple_of or 64)
    reporter = LoopReporter(args, pretrainer.engine.rank, cfg.train_iters, "iteration")
    if dynamic:
        reporter.describe_data = lambda last: (f" | {train_iter.describe()}" if last else "",
                                               dict(real_tokens=train_iter.real, computed_tokens=train_iter.computed,
                                                    fixed_tokens=train_iter.fixed))

    def evaluate(progress: TrainState, when: str) -> Dict:
        batches = cfg.eval_iters * cfg.num_microbatches
        with evaluating(model, precision, uses_cuda_graphs(args)):
            # summed on the device and reduced over workers once (a batch does not wait for the GPU)
            total = sum(pretrainer.run_forward_step(valid_iter, model).detach().float() for _ in range(batches))
        loss = mean_over_workers(total) / batches
        reporter.validation_loss(progress.iteration, loss, cfg.eval_iters)
        progress.consumed_valid_samples += cfg.eval_iters * cfg.global_batch_size  # what it read over all workers
        return {"loss": loss}

    validator = Validator(evaluate, every=cfg.eval_interval if valid_iter is not None else 0)
    step = TrainStep(model, optimizer, scheduler, precision, pretrainer.run_forward_step, cfg.clip_grad,
                     mark_step if uses_cuda_graphs(args) else None)
    data = IteratorBatches(train_iter, accum, cfg.global_batch_size, dynamic)
    TorchLoop(model, step, data, Stop(steps=cfg.train_iters), validator, reporter, checkpointer).train(progress)
    reporter.close()
    pretrainer.model = model
    return reporter.history
