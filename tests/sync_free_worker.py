"""One process of tests/test_gpu.py's host-synchronisation check: the engine's Trainer, as pretrain_megatron_gpt.py
runs it, with every training step after the first STEPS_EAGER run under torch.cuda.set_sync_debug_mode("error"):
any operation that makes the host wait for the GPU raises there, and the first one's Python stack is written to OUT.

    python tests/sync_free_worker.py OUT.json <engine flags>
"""
from __future__ import annotations

import json
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this tree's engine

STEPS_EAGER = 2  # compilation, lazy state and the first step's one-time copies happen here


def main(out: str, argv) -> None:
    from megatron_patch.config import parse_args
    from megatron_patch.parallel import destroy
    from megatron_patch.training.loop import Trainer

    result = {"checked_steps": 0, "sync": None}
    try:
        trainer = Trainer(parse_args(list(argv)))
        trainer.defer_step_metrics = True  # the metrics of a step are read after the next is queued (as on a GPU)
        step, calls = trainer.train_step, [0]

        def checked_step(iterator):
            calls[0] += 1
            if calls[0] <= STEPS_EAGER or result["sync"] is not None:
                return step(iterator)
            torch.cuda.set_sync_debug_mode("error")
            try:
                metrics = step(iterator)
                result["checked_steps"] += 1
                return metrics
            except RuntimeError as e:
                result["sync"] = f"{e}\n" + "".join(traceback.format_tb(e.__traceback__)[-8:])
                raise
            finally:
                torch.cuda.set_sync_debug_mode("default")

        trainer.train_step = checked_step
        try:
            trainer.train()
        except RuntimeError:
            pass  # recorded
    finally:
        with open(out, "w") as f:
            json.dump(result, f)
        destroy()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
