"""The one training loop of Hugging Face and plain PyTorch models: the Finetuner (epochs) and the PreTrainer with a
Hugging Face model (iterations) both run `TorchLoop.train()`; Megatron models run on the engine's loop
(training/loop.py).

`train()` stays a short loop because each part owns its decisions (torchtitan-style):
- `TrainStep`: one optimizer step. Each micro batch goes through the user's forward hook under autocast, its loss
  times its weight (1/accumulation, or dynamic-shape's share of the step's samples) is back-propagated, and the
  gradients are reduced across workers on the last micro batch only (`no_sync`); then the precision wrapper
  unscales, clips and steps, and the lr scheduler steps (not after a step fp16 skipped).
- a data source, which yields each step's micro batches: `EpochBatches` walks a DataLoader epoch by epoch (a new
  order each epoch); `IteratorBatches` draws from an endless iterator (Megatron's pretraining order) in one epoch.
- `Stop`: the stop rules, a number of optimizer steps and/or of epochs.
- the engine's components: `TrainState` (where training stands; `epoch` counts a fine-tuning run's epochs), the
  `Validator` (training/evaluation.py: before training, every N steps, after every epoch; never twice at one step)
  and the checkpointer (`training.checkpoint.torch_dcp.TorchCheckpointer`, a `SaveSchedule` like the engine's
  Checkpointer) whose `save(state, stopping)` decides when.
- `LoopReporter` (templates/reporting.py, on the engine's `RunOutputs`): log lines, TensorBoard scalars,
  --metrics-file.
"""
from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from megatron_patch.training.checkpoint.state import TrainState
from megatron_patch.training.evaluation import Validator

__all__ = ["TrainState", "Validator", "TrainStep", "EpochBatches", "IteratorBatches", "Stop", "TorchLoop",
           "accelerate_for_loop", "no_sync", "evaluating"]


@dataclass
class StepResult:
    loss: torch.Tensor  # this worker's loss of the step: the micro batches' losses, weighted
    lr: float  # the learning rate the step used
    grad_norm: Union[torch.Tensor, float, None]  # a device tensor until the reporter reads it
    skipped: bool  # fp16: inf/nan gradients, the step was skipped and the loss scale lowered


def no_sync(model: torch.nn.Module, sync: bool):
    """A context for one micro batch of gradient accumulation: gradients are reduced across workers only when
    `sync` (the last micro batch of a step); DDP's no_sync, FSDP2's set_requires_gradient_sync."""
    if sync:
        return contextlib.nullcontext()
    if hasattr(model, "no_sync"):
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(False)
        return _RestoreSync(model)
    return contextlib.nullcontext()


class _RestoreSync:
    def __init__(self, model) -> None:
        self.model = model

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.model.set_requires_gradient_sync(True)


def accelerate_for_loop(model: torch.nn.Module, optimizer, scheduler, args, device: torch.device, log):
    """Apply the acceleration switches to the hook's model and optimizer (logging each); returns (the
    `Accelerated` parts, the scheduler to use: the hook's, or None when the switches rebuilt its optimizer and
    the flags' schedule must be built instead)."""
    from megatron_patch.accelerations import accelerate

    acc = accelerate(model.to(device), args, device, optimizer)
    for line in acc.applied:
        log.info(f"acceleration: {line}")
    if scheduler is not None and getattr(scheduler, "optimizer", None) is not acc.optimizer:
        log.warning("the lr scheduler from model_optimizer_lr_scheduler_provider() drives the optimizer as it was "
                    "before the acceleration switches rebuilt it: using --lr-decay-style instead")
        scheduler = None
    return acc, scheduler


@contextlib.contextmanager
def evaluating(model: torch.nn.Module, precision, cuda_graphs: bool):
    """An evaluation pass of the torch loop's model: eval mode, no gradients, the precision's autocast, compiled
    modules run eagerly under CUDA-graph modes (`accelerations.eager_evaluation`: a replayed graph would overwrite
    outputs of earlier batches that the caller keeps), and train mode again afterwards."""
    from megatron_patch.accelerations import eager_evaluation

    model.eval()
    eager = eager_evaluation() if cuda_graphs else contextlib.nullcontext()
    try:
        with eager, torch.no_grad(), precision.autocast():
            yield model
    finally:
        model.train()


class TrainStep:
    """One optimizer step over a step's micro batches. `forward(input, model)` is the user's hook (its input: a
    batch, or the iterator it draws from); `before_forward` runs before each (CUDA graphs' mark_step)."""

    def __init__(self, model, optimizer, scheduler, precision, forward: Callable, clip_grad: float,
                 before_forward: Optional[Callable] = None) -> None:
        self.model, self.optimizer, self.scheduler, self.precision = model, optimizer, scheduler, precision
        self.forward, self.clip_grad, self.before_forward = forward, clip_grad, before_forward

    def __call__(self, inputs: Iterable, weights: Sequence[float]) -> StepResult:
        model, precision = self.model, self.precision
        total: Optional[torch.Tensor] = None
        last = len(weights) - 1
        for micro, (arg, weight) in enumerate(zip(inputs, weights)):
            if self.before_forward is not None:
                self.before_forward()
            with no_sync(model, micro == last):
                with precision.autocast():
                    loss = self.forward(arg, model)
                precision.backward(loss * weight)
            # a copy: under CUDA graphs `loss` is a graph output that the next step overwrites
            weighted = loss.detach().float() * weight
            total = weighted if total is None else total + weighted
        grad_norm, skipped = precision.step(self.optimizer, model, self.clip_grad)
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.optimizer.param_groups[0]["lr"]
        if not skipped:
            self.scheduler.step()
        return StepResult(total, lr, grad_norm, bool(skipped))  # read on the reporter's next line, not here


class EpochBatches:
    """A DataLoader walked epoch by epoch: each step takes `accum` micro batches, an epoch has len(loader) // accum
    steps (a trailing part of an accumulation is not a step), and the sampler reshuffles every epoch."""

    def __init__(self, loader, accum: int, world: int) -> None:
        self.loader, self.accum, self.world = loader, accum, world
        self.steps_per_epoch = max(1, len(loader) // accum)
        self.samples = 0  # this worker's samples of the step under way

    def epoch(self, progress: TrainState) -> Iterator[Tuple[Iterable, List[float]]]:
        if hasattr(self.loader.sampler, "set_epoch"):
            self.loader.sampler.set_epoch(progress.epoch)
        batches = iter(self.loader)
        for step in range(self.steps_per_epoch):
            count = min(self.accum, len(self.loader) - step * self.accum)
            self.samples = 0
            yield self._counted(batches, count), [1.0 / self.accum] * count

    def _counted(self, batches: Iterator, count: int) -> Iterator:
        for batch in itertools.islice(batches, count):  # drawn one at a time, as the forward asks
            # the samples: the first dimension of the batch (a tensor), of its first entry (a dict, a tuple)
            first = batch if torch.is_tensor(batch) else \
                next(iter(batch.values())) if hasattr(batch, "values") else batch[0]
            self.samples += int(first.shape[0]) if hasattr(first, "shape") else 0
            yield batch

    def step_samples(self) -> int:
        """The samples of the step just taken, over all workers (each worker's share is the same size)."""
        return self.samples * self.world


class IteratorBatches:
    """Micro batches from one endless iterator that the forward hook draws from: `accum` per step, or as many as
    dynamic-shape (`data.dynamic_shape.StepBuckets.next_step`) cuts the step's samples into, weighted by their share."""

    def __init__(self, iterator, accum: int, global_batch_size: int, dynamic: bool = False) -> None:
        self.iterator, self.accum, self.global_batch_size, self.dynamic = iterator, accum, global_batch_size, dynamic
        self.steps_per_epoch = None  # one epoch: the stop rule counts steps

    def epoch(self, progress: TrainState) -> Iterator[Tuple[Iterable, List[float]]]:
        while True:
            if self.dynamic:
                count = self.iterator.next_step()
                weights = list(self.iterator.weights)
            else:
                count, weights = self.accum, [1.0 / self.accum] * self.accum
            yield itertools.repeat(self.iterator, count), weights

    def step_samples(self) -> int:
        return self.global_batch_size


@dataclass(frozen=True)
class Stop:
    """The stop rules: after `steps` optimizer steps, or at the end of epoch `epochs` (None: no such rule)."""
    steps: Optional[int] = None
    epochs: Optional[int] = None

    def done(self, progress: TrainState, epoch_over: bool = False) -> bool:
        if self.steps is not None and progress.iteration >= self.steps:
            return True
        return epoch_over and self.epochs is not None and progress.epoch >= self.epochs


class TorchLoop:
    """Train until a stop rule says so: each step through `step`, then the reporter, the validator and the
    checkpointer decide what else happens."""

    def __init__(self, model: torch.nn.Module, step: TrainStep, data, stop: Stop, validator: Validator, reporter,
                 checkpointer: Any = None) -> None:
        self.model, self.step, self.data, self.stop = model, step, data, stop
        self.validator, self.reporter = validator, reporter
        self.checkpointer = checkpointer  # None: a run that writes no checkpoints (the Finetuner: save_pretrained)

    def train(self, progress: TrainState) -> TrainState:
        self.validator.start(progress)
        self.model.train()  # from_pretrained returns a model in eval mode: dropout off, and ORT would export inference
        while not self.stop.done(progress):
            with self.reporter.epoch(progress, self.data.steps_per_epoch):
                for inputs, weights in self.data.epoch(progress):
                    result = self.step(inputs, weights)
                    progress.iteration += 1
                    progress.consumed_samples += self.data.step_samples()
                    self.reporter.train_step(progress, result, self.data.step_samples())
                    # evaluate, then save: the checkpoint holds the validation position after this step's evaluation
                    evaluated = self.validator.after_step(progress)
                    saved = self.checkpointer is not None and bool(self.checkpointer.save(progress))
                    if evaluated or saved:
                        self.reporter.restart_clock()  # samples/s counts training only
                    if self.stop.done(progress):
                        break
            self.validator.after_epoch(progress)
            if self.stop.done(progress, epoch_over=True):
                break
            progress.epoch += 1
        if self.checkpointer is not None:
            self.checkpointer.save(progress, stopping=True)
        return progress
