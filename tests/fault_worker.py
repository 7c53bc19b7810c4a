"""A pretraining worker that dies: pretrain_megatron_gpt.py's main, except that the worker of rank FAULT_RANK (1) kills
itself with SIGKILL (no clean-up, as a crashed or OOM-killed process) just before training iteration FAULT_AT + 1,
on the first attempt only, or on every attempt with FAULT_EVERY_ATTEMPT=1. FAULT_SIGNAL=SIGSTOP stops it instead (a
hung worker), FAULT_SIGNAL=LOOP keeps it busy forever (alive, no progress); FAULT_STAMP=FILE records the time and the pid. FAULT_SLOW_SAVE=N (with --async-save): the background
write of iteration N's checkpoint never ends on the first attempt (the fault then strikes during that save). Run under torchrun by
tests/test_restart.py.

    FAULT_AT=3 torchrun --nproc-per-node 2 --max-restarts 1 tests/fault_worker.py <engine flags>
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

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
            if os.environ.get("FAULT_STAMP"):  # when and which process: the hang test checks the bound and the pid
                with open(os.environ["FAULT_STAMP"], "w") as f:
                    f.write(f"{time.time()} {os.getpid()}")
            if os.environ.get("FAULT_SIGNAL") == "SIGSTOP":
                time.sleep(0.5)  # a hang inside the step, not at its first instruction
            if os.environ.get("FAULT_SIGNAL") == "LOOP":  # alive (its heartbeat goes on) but never reaches the step
                while True:
                    time.sleep(0.1)
            os.kill(os.getpid(), getattr(signal, os.environ.get("FAULT_SIGNAL", "SIGKILL")))
        return step(self, iterator)

    loop.Trainer.train_step = train_step
    slow = os.environ.get("FAULT_SLOW_SAVE")  # --async-save: this iteration's background write hangs (first attempt)
    if slow and first_attempt:
        from megatron_patch.training.checkpoint import async_save

        write = async_save._write

        def slow_write(fn, args, kwargs):
            if threading.current_thread().name.endswith(f"-{int(slow)}"):  # the thread of iteration N's save
                time.sleep(3600)
            write(fn, args, kwargs)

        async_save._write = slow_write
    return pretrain(sys.argv[1:], model="gpt")


if __name__ == "__main__":
    sys.exit(main())
