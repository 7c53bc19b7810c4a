"""Automatic restart (torchrun's elastic restarts: `torchrun --max-restarts N`, the launchers' MAX_RESTARTS): when a
worker dies, torchrun stops the others and starts every worker again, up to N times. Each new attempt of the engine
resumes by itself from the newest complete checkpoint of its --save directory (the tracker is written only after a
checkpoint is complete, so a save that was cut short is never loaded), with its iteration, data position and RNG
states, and says so in one line. An attempt that resumes from the same iteration as the attempt before it says that
too: a run that keeps failing at the same place stops when torchrun's restarts run out, and the last lines name the
iteration it could not get past.

Torch-free (the entry point calls it before validate()): it reads the environment torchrun gives each attempt
(TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS) and the checkpoint tracker on disk. The attempts of one run
are recorded in SAVE/restarts.jsonl (one line per restarted attempt, written by rank 0).
"""
from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Optional, Tuple

from .checkpoint_layout import TRACKER

if TYPE_CHECKING:
    from .config import Config

RESTARTS_FILE = "restarts.jsonl"


def restart_count() -> int:
    """0 for a first attempt (or without torchrun), k for torchrun's k-th restart."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def max_restarts() -> int:
    """torchrun's --max-restarts for this job (0 without torchrun)."""
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)


def _tracked_iteration(save: str) -> Optional[int]:
    try:
        with open(os.path.join(save, TRACKER)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def restart_resume(save: Optional[str]) -> Tuple[Optional[str], Optional[str]]:
    """On a restarted attempt: (the directory to load, --save when it holds a complete checkpoint, else None; the line
    that says what the attempt does). On a first attempt: (None, None)."""
    attempt = restart_count()
    if attempt == 0:
        return None, None
    limit = os.environ.get("TORCHELASTIC_MAX_RESTARTS", "?")
    iteration = _tracked_iteration(save) if save else None
    if iteration is None:
        where = f"in --save {save} yet" if save else "to resume from (no --save)"
        return None, (f"restart {attempt} of {limit} (torchrun --max-restarts): no complete checkpoint {where}, "
                      "starting over as the first attempt did")
    previous = _previous_iteration(save)
    _record(save, attempt, iteration)
    again = (f"; the attempt before this one resumed from iteration {iteration} too: the run fails after it"
             if previous == iteration else "")
    return save, (f"restart {attempt} of {limit} (torchrun --max-restarts): resuming from iteration {iteration}, the "
                  f"newest complete checkpoint in {save}{again}")


def resume_after_restart(cfg: "Config") -> Tuple["Config", Optional[str]]:
    """On a restarted attempt whose --save holds a complete checkpoint: `cfg` loading it (--load SAVE, in place of
    --load or --load-hf), and the line that says so; otherwise `cfg` unchanged and the line (None: a first
    attempt)."""
    load, line = restart_resume(cfg.save)
    return (cfg.replace(load=load, load_hf=None) if load else cfg), line


def _previous_iteration(save: str) -> Optional[int]:
    try:
        with open(os.path.join(save, RESTARTS_FILE)) as f:
            lines = [json.loads(x) for x in f if x.strip()]
        return lines[-1]["iteration"] if lines else None
    except (OSError, ValueError, KeyError):
        return None


def _record(save: str, attempt: int, iteration: int) -> None:
    if int(os.environ.get("RANK", "0")) != 0:
        return
    with open(os.path.join(save, RESTARTS_FILE), "a") as f:
        f.write(json.dumps({"attempt": attempt, "iteration": iteration}) + "\n")
