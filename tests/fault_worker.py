"""A pretraining worker that dies: pretrain_megatron_gpt.py's main, except that the worker of rank FAULT_RANK (1) kills
itself with SIGKILL (no clean-up, as a crashed or OOM-killed process) just before training iteration FAULT_AT + 1,
on the first attempt only, or on every attempt with FAULT_EVERY_ATTEMPT=1. Run under torchrun by
tests/test_restart.py.

    FAULT_AT=3 torchrun --nproc-per-node 2 --max-restarts 1 tests/fault_worker.py <engine flags>
"""
from __future__ import annotations

import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this tree's engine


def main() -> int:
    from megatron_patch.cli.pretrain import main as pretrain
    from megatron_patch.training import loop

    step = loop.Trainer.train_step
    first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0

    def train_step(self, iterator):
        if (self.state.iteration == int(os.environ["FAULT_AT"])
                and int(os.environ["RANK"]) == int(os.environ.get("FAULT_RANK", "1"))
                and (first_attempt or os.environ.get("FAULT_EVERY_ATTEMPT") == "1")):
            os.kill(os.getpid(), signal.SIGKILL)
        return step(self, iterator)

    loop.Trainer.train_step = train_step
    return pretrain(sys.argv[1:], model="gpt")


if __name__ == "__main__":
    sys.exit(main())
