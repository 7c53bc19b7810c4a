"""Automatic restart (config/restart.py, parallel/initialize.py): one of two workers killed with SIGKILL mid-run,
after a checkpoint; torchrun (--max-restarts) starts the job again and the new attempt resumes by itself from the
newest complete checkpoint, finishing with exit status 0 and the losses of a run that was never interrupted (fp32,
dropout on: the data position and the RNG states come back with the checkpoint). A worker that dies at the same
iteration on every attempt ends the job when the restarts run out, the last attempt naming the iteration."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine_utils import ROOT, TINY, free_port, run_engine

ARGS = ["--train-iters", "6", "--eval-iters", "0", "--save-interval", "2", "--hidden-dropout", "0.1",
        "--attention-dropout", "0.1"]


def _torchrun(workdir, max_restarts: int, env: dict, *args: str):
    os.makedirs(workdir, exist_ok=True)
    metrics = os.path.join(str(workdir), "metrics.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts",
           str(max_restarts), "--master-port", str(free_port()), os.path.join(ROOT, "tests", "fault_worker.py"),
           *TINY, *args, "--metrics-file", metrics]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=str(workdir), timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **env))
    lines = [json.loads(x) for x in open(metrics)] if os.path.exists(metrics) else []
    return proc, lines


def _last_per_iteration(lines):
    """iteration -> loss, the last attempt's where several wrote it (attempts append to the metrics file)."""
    return {x["iteration"]: x["loss"] for x in lines if "loss" in x}


def test_killed_worker_restarts_and_finishes_like_an_uninterrupted_run(tmp_path):
    straight, _ = run_engine(tmp_path / "straight", 2, *ARGS, "--save", str(tmp_path / "straight" / "ck"),
                             torchrun=False)
    proc, lines = _torchrun(tmp_path / "faulty", 1, {"FAULT_AT": "3"}, *ARGS, "--save", str(tmp_path / "faulty" / "ck"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ("restart 1 of 1 (torchrun --max-restarts): resuming from iteration 2, the newest complete checkpoint in "
            f"{tmp_path / 'faulty' / 'ck'}") in proc.stdout
    want = _last_per_iteration(straight)
    got = _last_per_iteration(lines)
    assert sorted(got) == sorted(want) == list(range(1, 7))
    assert [x["iteration"] for x in lines if "loss" in x] == [1, 2, 3, 3, 4, 5, 6]  # 3 was run twice: it was lost
    assert [got[i] for i in range(1, 7)] == pytest.approx([want[i] for i in range(1, 7)], rel=1e-6)


def test_a_run_failing_at_the_same_iteration_stops_when_the_restarts_run_out(tmp_path):
    proc, lines = _torchrun(tmp_path, 2, {"FAULT_AT": "3", "FAULT_EVERY_ATTEMPT": "1"}, *ARGS,
                            "--save", str(tmp_path / "ck"))
    assert proc.returncode != 0
    assert "restart 1 of 2 (torchrun --max-restarts): resuming from iteration 2" in proc.stdout
    assert ("restart 2 of 2 (torchrun --max-restarts): resuming from iteration 2, the newest complete checkpoint in "
            f"{tmp_path / 'ck'}; the attempt before this one resumed from iteration 2 too: the run fails after it"
            ) in proc.stdout
    assert max(x["iteration"] for x in lines if "loss" in x) == 3
