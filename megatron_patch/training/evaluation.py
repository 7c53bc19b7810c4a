"""`Validator`, when to evaluate (both training loops), and `ValidationStream`, where in the validation set.

As in Megatron-LM, a pretraining run's evaluations walk on through the validation set rather than restarting at
its first sample: each evaluation takes the next --eval-iters global batches, and the position
(`consumed_valid_samples`) is saved with checkpoints so a resumed run evaluates the same batches the
uninterrupted run would. The set is sized for every evaluation of the run; it wraps around if needed.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

from megatron_patch.config import Config

from .checkpoint.state import TrainState


class Validator:
    """When to evaluate: before training (`at_start`), every `every` iterations (0: not on the way), after every
    epoch (`each_epoch`), never twice at one iteration. `evaluate(state, when)` ("start", "step" or "epoch") runs
    one evaluation and returns its result, which `last` keeps.

    The engine's loop asks `should_run(iteration)` and calls `run(state)` once the step is finished; the torch
    loop calls `start`, `after_step` and `after_epoch`."""

    def __init__(self, evaluate: Callable[[TrainState, str], Any], every: int = 0, at_start: bool = False,
                 each_epoch: bool = False) -> None:
        self.evaluate, self.every, self.at_start, self.each_epoch = evaluate, every or 0, at_start, each_epoch
        self.last: Any = {}
        self.evaluated = -1  # the iteration of the newest evaluation during training

    def should_run(self, iteration: int) -> bool:
        return bool(self.every) and iteration % self.every == 0

    def run(self, state: TrainState, when: str = "step") -> Any:
        self.last, self.evaluated = self.evaluate(state, when), state.iteration
        return self.last

    def start(self, state: TrainState) -> bool:
        if self.at_start:
            self.evaluate(state, "start")
        return self.at_start

    def after_step(self, state: TrainState) -> bool:
        if self.should_run(state.iteration):
            self.run(state, "step")
            return True
        return False

    def after_epoch(self, state: TrainState) -> bool:
        if self.each_epoch and self.evaluated != state.iteration:  # unless just evaluated
            self.run(state, "epoch")
            return True
        return False


class ValidationStream:
    """The engine's evaluation: the mean loss over the next --eval-iters global batches of `dataset`, from the
    position the run (or its checkpoint) has reached; `every` is --eval-interval when there is something to
    evaluate (a validation set and --eval-iters), else 0."""

    def __init__(self, cfg: Config, dataset, make_iterator: Callable[[object, int], Iterator],
                 evaluate: Callable[[Iterator, int], float]) -> None:
        self.cfg, self.dataset = cfg, dataset
        self.make_iterator, self.evaluate = make_iterator, evaluate
        self._iterator: Optional[Iterator] = None
        self.every = (cfg.eval_interval or 0) if dataset is not None and cfg.eval_iters > 0 else 0

    def __call__(self, state: TrainState, when: str = "step") -> float:
        """Mean loss over the next --eval-iters global batches; advances `state.consumed_valid_samples`."""
        if self._iterator is None:
            self._iterator = self.make_iterator(self.dataset, state.consumed_valid_samples)
        loss = self.evaluate(self._iterator, self.cfg.eval_iters)
        state.consumed_valid_samples += self.cfg.eval_iters * self.cfg.global_batch_size
        return loss
