"""Checkpoints written before a change of the configuration still load and continue exactly (issue 28 part 6).

tests/data/engine_checkpoint_v1 holds a tiny GPT checkpoint at iteration 3 written by the engine at f3400d6 (before
the configuration was reorganised) and what that run logged afterwards. Today's engine resumes it with the same
flags (dropout on: its RNG states must be restored too) and must log the same iterations 4-6 and validation loss.
tests/data/hf_checkpoint_v1 does the same for the Hugging Face PreTrainer's checkpoints (a tiny BERT, its data
and vocabulary included). (One process each, 3 iterations: about 10 s each.)"""
from __future__ import annotations

import json
import os
import shutil

from engine_utils import run_engine

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "engine_checkpoint_v1")


def _continues_as_logged(got, expected, kind) -> None:
    """The same lines (iteration and `kind`: training or validation) as the earlier version's run logged, each
    loss, gradient norm and learning rate it logged within 1e-6 (relative above 1)."""
    assert [(g["iteration"], kind(g)) for g in got] == [(e["iteration"], kind(e)) for e in expected], (got, expected)
    for g, e in zip(got, expected):
        for key in ("loss", "valid_loss", "grad_norm", "lr"):
            if key in e:
                assert abs(g[key] - e[key]) <= 1e-6 * max(1.0, abs(e[key])), (key, g, e)


def test_engine_checkpoint_of_an_earlier_version_resumes_exactly(tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(os.path.join(DATA, "ck"), ck)
    with open(os.path.join(DATA, "flags.txt")) as f:
        flags = f.read().split()
    with open(os.path.join(DATA, "continuation.jsonl")) as f:
        expected = [json.loads(line) for line in f]
    lines, proc = run_engine(tmp_path, 1, "--load", str(ck), "--save", str(ck), base=flags)
    assert "loaded checkpoint" in proc.stdout and "(iteration 3)" in proc.stdout, proc.stdout[-2000:]
    _continues_as_logged(lines, expected, lambda line: "valid_loss" in line)


HF_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "hf_checkpoint_v1")


def test_hf_pretrainer_checkpoint_of_an_earlier_version_resumes_exactly(tmp_path):
    """The Hugging Face PreTrainer (the how-to's BERT sample, dropout on) resumes a checkpoint of f3400d6 at
    iteration 3 and logs that run's iterations 4-6 and validation loss. (One worker: about 15 s.)"""
    from finetune_utils import ROOT, explain, rapidformer

    data = tmp_path / "data"
    shutil.copytree(HF_DATA, data)
    with open(data / "flags.txt") as f:
        flags = f.read().replace("{DATA}", str(data)).split()
    flags[flags.index("--user-script") + 1] = os.path.join(ROOT, flags[flags.index("--user-script") + 1])
    with open(data / "continuation.jsonl") as f:
        expected = [json.loads(line) for line in f]
    ck = data / "ck"
    proc = rapidformer(*flags, "--load", str(ck), "--save", str(ck), "--metrics-file", str(tmp_path / "m.jsonl"))
    assert proc.returncode == 0, explain(proc)
    assert "resumed from" in proc.stdout and "at iteration 3" in proc.stdout, explain(proc)
    with open(tmp_path / "m.jsonl") as f:
        got = [json.loads(line) for line in f if line.strip()]
    _continues_as_logged(got, expected, lambda line: line.get("split"))
