"""What both training loops share about checkpoints: `TrainState`, where training stands, and `SaveSchedule`, when
to save. The engine's `Checkpointer` (megatron-core models) and the torch loop's `TorchCheckpointer` (Hugging Face
and plain PyTorch models) are both a `SaveSchedule` with a backend. No torch or megatron-core import here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional


@dataclass
class TrainState:
    """Where training stands: what a checkpoint records besides the model, optimizer and RNG."""
    iteration: int = 0  # optimizer steps done
    consumed_samples: int = 0  # training samples, over all data-parallel ranks
    consumed_valid_samples: int = 0  # validation samples, so evaluation walks on through the set
    epoch: int = 1  # the epoch under way (from 1): the torch loop's epochs of a fine-tuning run; not saved

    def saved(self) -> Dict[str, int]:
        """The entries a checkpoint's manifest stores."""
        return {"iteration": self.iteration, "consumed_samples": self.consumed_samples,
                "consumed_valid_samples": self.consumed_valid_samples}


class SaveSchedule:
    """When to save under `root` (None or "": never): every `interval` iterations (0: not on the way), and when
    training stops, unless that iteration is saved already (`last_saved`) or, once `start` is set (the iteration a
    resumed torch-loop run started from), the run trained nothing since it."""

    def __init__(self, root: Optional[str], interval: int) -> None:
        self.root, self.interval = root, interval or 0
        self.last_saved: Optional[int] = None
        self.start: Optional[int] = None

    def should_save(self, iteration: int, stopping: bool = False) -> bool:
        """True at every --save-interval, and when training stops (see the class)."""
        if not self.root or iteration == self.last_saved:
            return False
        if stopping:
            return self.start is None or iteration > self.start
        return bool(self.interval and iteration % self.interval == 0)
