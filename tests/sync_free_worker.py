"""One process of tests/test_gpu.py's host-synchronisation check: the engine's Trainer, as pretrain_megatron_gpt.py
runs it, with every training step after the first STEPS_EAGER run under torch.cuda.set_sync_debug_mode("warn"):
every operation that makes the host wait for the GPU warns there; the first one's Python stack and up to 12 distinct
ones are written to OUT.

    python tests/sync_free_worker.py OUT.json <engine flags>
"""
from __future__ import annotations

import json
import os
import sys
import traceback
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this tree's engine

STEPS_EAGER = 2  # compilation, lazy state and the first step's one-time copies happen here


def main(out: str, argv) -> None:
    from megatron_patch.config import parse_args
    from megatron_patch.parallel import destroy
    from megatron_patch.training.loop import Trainer

    result = {"checked_steps": 0, "sync": None, "sites": []}
    try:
        trainer = Trainer(parse_args(list(argv)))
        trainer.defer_step_metrics = True  # the metrics of a step are read after the next is queued (as on a GPU)
        step, calls = trainer.train_step, [0]

        def checked_step(iterator):
            calls[0] += 1
            if calls[0] <= STEPS_EAGER:
                return step(iterator)
            torch.cuda.set_sync_debug_mode("warn")
            shown = warnings.showwarning

            def record(message, *a, **k):  # every distinct place that synchronised, its Python stack
                if "synchronizing CUDA operation" in str(message):
                    site = f"{message}\n" + "".join(traceback.format_stack()[-9:-1])
                    result["sync"] = result["sync"] or site
                    if site not in result["sites"] and len(result["sites"]) < 12:
                        result["sites"].append(site)
                else:
                    shown(message, *a, **k)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("always")
                    warnings.showwarning = record
                    metrics = step(iterator)
                result["checked_steps"] += 1
                return metrics
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
