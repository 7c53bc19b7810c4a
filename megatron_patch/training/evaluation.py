"""`Validator`: when to evaluate, and where in the validation set.

As in Megatron-LM, evaluations walk on through the validation set rather than restarting at its first
sample: each evaluation takes the next --eval-iters global batches, and the position
(`consumed_valid_samples`) is saved with checkpoints so a resumed run evaluates the same batches the
uninterrupted run would. The set is sized for every evaluation of the run; it wraps around if needed.
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional

from megatron_patch.config import Config

from .checkpoint import TrainState


class Validator:
    def __init__(self, cfg: Config, dataset, make_iterator: Callable[[object, int], Iterator],
                 evaluate: Callable[[Iterator, int], float]) -> None:
        self.cfg, self.dataset = cfg, dataset
        self.make_iterator, self.evaluate = make_iterator, evaluate
        self._iterator: Optional[Iterator] = None

    def should_run(self, iteration: int) -> bool:
        c = self.cfg
        return self.dataset is not None and c.eval_iters > 0 and bool(c.eval_interval) and iteration % c.eval_interval == 0

    def run(self, state: TrainState) -> float:
        """Mean loss over the next --eval-iters global batches; advances `state.consumed_valid_samples`."""
        if self._iterator is None:
            self._iterator = self.make_iterator(self.dataset, state.consumed_valid_samples)
        loss = self.evaluate(self._iterator, self.cfg.eval_iters)
        state.consumed_valid_samples += self.cfg.eval_iters * self.cfg.global_batch_size
        return loss
