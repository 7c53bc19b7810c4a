"""pretrain_scripts/run_gpt.sh as a new user runs it: demo data built offline, a tiny GPT trains, loss falls."""
import json
import os
import subprocess

from engine_utils import ROOT


def test_run_gpt_sh_defaults_train_and_save(tmp_path):
    env = dict(os.environ, TRAIN_ITERS="60", LOG_INTERVAL="10", EVAL_INTERVAL="30", OUTPUT=str(tmp_path / "out"),
               DEMO_DIR=str(tmp_path / "demo"), PYTHONWARNINGS="ignore")
    proc = subprocess.run(["bash", os.path.join(ROOT, "pretrain_scripts", "run_gpt.sh")], capture_output=True,
                          text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(x) for x in open(tmp_path / "out" / "metrics.jsonl")]
    losses = [x["loss"] for x in lines if "loss" in x]
    assert len(losses) == 60
    assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10 - 1.0  # clearly learning the demo corpus
    assert "validation at iteration 60" in proc.stdout and "tokens/s" in proc.stdout
    assert (tmp_path / "out" / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "60"
    assert os.listdir(tmp_path / "out" / "tensorboard")


def test_run_llama_sh_with_tensor_parallel(tmp_path):
    env = dict(os.environ, TRAIN_ITERS="10", LOG_INTERVAL="5", EVAL_INTERVAL="10", OUTPUT=str(tmp_path / "out"),
               DEMO_DIR=str(tmp_path / "demo"), GPUS="2", TP="2", PYTHONWARNINGS="ignore")
    proc = subprocess.run(["bash", os.path.join(ROOT, "pretrain_scripts", "run_llama.sh"), "--save-interval", "5"],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "model: llama" in proc.stdout and "TP 2 PP 1 DP 1" in proc.stdout
    assert (tmp_path / "out" / "checkpoints" / "iter_0000005").is_dir()
