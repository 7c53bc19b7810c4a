"""pretrain_scripts/run_sft.sh as a user runs it: the built-in demo (a chat set, a tiny Qwen3 with random weights, its
ChatML template), packed SFT whose validation loss falls, and the verified export."""
from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_sft(tmp_path, *args, **env):
    full = dict(os.environ, OUTPUT=str(tmp_path / "out"), SFT_DEMO_DIR=str(tmp_path / "demo"), CONVERSATIONS="400",
                PYTHONWARNINGS="ignore", **env)
    for name in ("DATA_PATH", "HF_MODEL", "GPUS", "TP", "PP", "SAVE", "TRAIN_ITERS", "CHATS"):
        if name not in env:
            full.pop(name, None)
    return subprocess.run(["bash", os.path.join(ROOT, "pretrain_scripts", "run_sft.sh"), *args], capture_output=True,
                          text=True, env=full, timeout=900)


@pytest.mark.slow  # CI time: each part (data, packed SFT, LoRA, export) is guarded by test_sft.py and test_lora.py
def test_run_sft_sh_checks_its_demo_configuration(tmp_path):
    """No arguments but --validate-only: the demo is built (chat set, tokenizer, model, rendered data) and the whole
    configuration is checked for the launch: SFT on the model's own directory, packed, loss on assistant tokens."""
    proc = run_sft(tmp_path, "--validate-only")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SFT: " in proc.stderr and "conversations (packed)" in proc.stderr, proc.stderr[-3000:]
    assert (tmp_path / "demo" / "qwen3_tiny" / "config.json").exists()
    assert not (tmp_path / "out" / "hf").exists()  # --validate-only exports nothing


@pytest.mark.slow  # CI time: test_sft.py and test_lora.py guard each part (data, packing, training, export)
def test_run_sft_sh_fine_tunes_and_exports(tmp_path):
    proc = run_sft(tmp_path, "--eval-interval", "20", TRAIN_ITERS="60")
    assert proc.returncode == 0, proc.stderr[-3000:]
    valid = [json.loads(x)["valid_loss"] for x in open(tmp_path / "out" / "metrics.jsonl") if "valid_loss" in x]
    assert len(valid) == 3 and valid[-1] < valid[0] - 0.5, valid
    assert re.search(r"verify passed", proc.stdout + proc.stderr)
    assert (tmp_path / "out" / "hf" / "config.json").exists()
