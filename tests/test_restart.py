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
import time

import pytest

from engine_utils import ROOT, TINY, free_port, run_engine, run_in_group

ARGS = ["--train-iters", "6", "--eval-iters", "0", "--save-interval", "2", "--hidden-dropout", "0.1",
        "--attention-dropout", "0.1"]


def _torchrun(workdir, max_restarts: int, env: dict, *args: str):
    os.makedirs(workdir, exist_ok=True)
    metrics = os.path.join(str(workdir), "metrics.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts",
           str(max_restarts), "--master-port", str(free_port()), os.path.join(ROOT, "tests", "fault_worker.py"),
           *TINY, *args, "--metrics-file", metrics]
    proc = run_in_group(cmd, 300, cwd=str(workdir),
                        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **env))
    lines = [json.loads(x) for x in open(metrics)] if os.path.exists(metrics) else []
    return proc, lines


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted 2-process run (synchronous saves) the interrupted ones must equal."""
    d = tmp_path_factory.mktemp("straight")
    lines, _ = run_engine(d, 2, *ARGS, "--save", str(d / "ck"), torchrun=False)
    return lines


def _last_per_iteration(lines):
    """iteration -> loss, the last attempt's where several wrote it (attempts append to the metrics file)."""
    return {x["iteration"]: x["loss"] for x in lines if "loss" in x}


@pytest.mark.slow  # CI time: the default lane's kill-and-restart guard is the --async-save one below (same restart path)
def test_killed_worker_restarts_and_finishes_like_an_uninterrupted_run(tmp_path, straight):
    proc, lines = _torchrun(tmp_path / "faulty", 1, {"FAULT_AT": "3"}, *ARGS, "--save", str(tmp_path / "faulty" / "ck"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ("restart 1 of 1 (torchrun --max-restarts): resuming from iteration 2, the newest complete checkpoint in "
            f"{tmp_path / 'faulty' / 'ck'}") in proc.stdout
    want = _last_per_iteration(straight)
    got = _last_per_iteration(lines)
    assert sorted(got) == sorted(want) == list(range(1, 7))
    assert [x["iteration"] for x in lines if "loss" in x] == [1, 2, 3, 3, 4, 5, 6]  # 3 was run twice: it was lost
    assert [got[i] for i in range(1, 7)] == pytest.approx([want[i] for i in range(1, 7)], rel=1e-6)


def test_an_attempt_resuming_where_the_one_before_did_says_so(tmp_path, monkeypatch):
    """config/restart.py's lines: restart 1 resumes from the tracker's iteration; restart 2 from the same one names it
    (the run fails after it); no checkpoint yet: starting over."""
    from megatron_patch.config.restart import restart_resume

    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert restart_resume(str(tmp_path)) == (None, f"restart 1 of 2 (torchrun --max-restarts): no complete checkpoint "
                                                   f"in --save {tmp_path} yet, starting over as the first attempt did")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")
    assert restart_resume(str(tmp_path)) == (str(tmp_path), "restart 1 of 2 (torchrun --max-restarts): resuming from "
                                             f"iteration 2, the newest complete checkpoint in {tmp_path}")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert restart_resume(str(tmp_path))[1].endswith(
        "; the attempt before this one resumed from iteration 2 too: the run fails after it")


@pytest.mark.slow  # CI time: the lines are checked by the test above, the restart itself by the --async-save kill
def test_a_run_failing_at_the_same_iteration_stops_when_the_restarts_run_out(tmp_path):
    proc, lines = _torchrun(tmp_path, 2, {"FAULT_AT": "3", "FAULT_EVERY_ATTEMPT": "1"}, *ARGS,
                            "--save", str(tmp_path / "ck"))
    assert proc.returncode != 0
    assert "restart 1 of 2 (torchrun --max-restarts): resuming from iteration 2" in proc.stdout
    assert ("restart 2 of 2 (torchrun --max-restarts): resuming from iteration 2, the newest complete checkpoint in "
            f"{tmp_path / 'ck'}; the attempt before this one resumed from iteration 2 too: the run fails after it"
            ) in proc.stdout
    assert max(x["iteration"] for x in lines if "loss" in x) == 3


def test_a_worker_killed_during_an_async_save_resumes_from_the_previous_checkpoint(tmp_path, straight):
    """--async-save: the checkpoint of iteration 4 is still being written (its write never ends) when rank 1 dies
    before iteration 6; the tracker still names iteration 2, the restarted attempt resumes from it and ends with the
    losses of an uninterrupted synchronous run."""
    ck = tmp_path / "faulty" / "ck"
    proc, lines = _torchrun(tmp_path / "faulty", 1, {"FAULT_AT": "5", "FAULT_SLOW_SAVE": "4"}, *ARGS,
                            "--save", str(ck), "--async-save")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "writing in the background (--async-save)" in proc.stdout
    assert f"restart 1 of 1 (torchrun --max-restarts): resuming from iteration 2, the newest complete checkpoint in {ck}" \
        in proc.stdout
    assert [x["iteration"] for x in lines if "loss" in x] == [1, 2, 3, 4, 5, 3, 4, 5, 6]
    want, got = _last_per_iteration(straight), _last_per_iteration(lines)
    assert [got[i] for i in range(1, 7)] == pytest.approx([want[i] for i in range(1, 7)], rel=1e-6)
    assert sorted(os.listdir(ck)) == ["iter_0000002", "iter_0000004", "iter_0000006",
                                      "latest_checkpointed_iteration.txt", "restarts.jsonl"]


# ---- rapidformer --max-restarts ------------------------------------------------------------------------------------
def test_rapidformer_max_restarts_runs_torchrun_with_restarts_and_the_attempt_loads_save(tmp_path, monkeypatch):
    """The launcher passes torchrun --max-restarts (also for one worker: restarts need torchrun's agent); a restarted
    worker's flags load --save's newest complete checkpoint and rank 0 says so; a first attempt changes nothing."""
    import argparse

    from megatron_patch.cli import launch, worker

    cmd = launch.torchrun_command(["--task", "pretraining"], 1, max_restarts=3)
    assert "--max-restarts=3" in cmd and cmd.index("--max-restarts=3") < cmd.index("megatron_patch.cli.worker")
    assert not [c for c in launch.torchrun_command([], 2) if c.startswith("--max-restarts")]
    save = tmp_path / "ck"
    save.mkdir()
    (save / "latest_checkpointed_iteration.txt").write_text("5")
    args = argparse.Namespace(save=str(save), load="model_dir")
    worker._resume_after_restart(args)
    assert args.load == "model_dir"  # first attempt
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    monkeypatch.setenv("RANK", "0")
    worker._resume_after_restart(args)
    assert args.load == str(save)


def test_rapidformer_max_restarts_is_refused_for_fine_tuning_and_below_zero():
    from finetune_utils import rapidformer
    from megatron_patch.config.flag_use import refuse_unused
    from megatron_patch.config.rapidformer_flags import UsageError, parse_args as front_args

    args = front_args(["--task", "sequence_classification", "--max-restarts", "2"])
    with pytest.raises(UsageError, match="--max-restarts 2: pretraining: a job whose worker died starts again .*"
                                         r"Black-box fine-tuning \(--task sequence_classification\) does not use it: drop it"):
        refuse_unused(args, ["ft"])
    refuse_unused(front_args(["--task", "pretraining", "--max-restarts", "2"]), ["pt"])  # acts there
    proc = rapidformer("--task", "pretraining", "--max-restarts", "-1")
    assert proc.returncode == 2 and "--max-restarts -1: give 0 or more restarts" in proc.stderr, proc.stderr[-2000:]


def test_a_launch_that_times_out_leaves_no_worker_behind(tmp_path):
    """run_in_group (the tests' torchrun launches): at the timeout the launcher's children die with it."""
    pid_file = tmp_path / "child"
    code = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
            f" open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    start = time.time()
    with pytest.raises(subprocess.TimeoutExpired):
        run_in_group([sys.executable, "-c", code], 3)
    assert time.time() - start < 20  # a child left alive holds the output pipes open: it would wait for its sleep
    status = f"/proc/{int(pid_file.read_text())}/status"
    time.sleep(0.5)
    # gone, or a zombie waiting for whoever adopted it to reap it
    assert not os.path.exists(status) or "\tZ" in open(status).read().split("State:")[1].splitlines()[0]
