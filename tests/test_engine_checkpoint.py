"""Checkpoints: stopping and resuming reproduces the straight run; weights load into other TP/PP layouts."""
import os

import pytest
import torch

from engine_utils import full_weights, run_engine, train_losses


@pytest.mark.parametrize("nproc,extra", [(1, []), (2, ["--zero-1-memory-optimization"]),
                                         (2, ["--zero-2-memory-optimization"]),
                                         (2, ["--zero-2-memory-optimization", "--bf16"])],
                         ids=["single", "dp2_zero1", "dp2_zero2", "dp2_zero2_bf16"])
def test_resume_is_exact(tmp_path, nproc, extra):
    ten = ["--train-iters", "10", "--eval-interval", "100"]
    straight, _ = run_engine(tmp_path / "straight", nproc, *ten, *extra, "--save", str(tmp_path / "straight" / "ckpt"))
    first, _ = run_engine(tmp_path / "first", nproc, *ten, *extra, "--exit-interval", "5", "--save", str(tmp_path / "ck"))
    assert len(train_losses(first)) == 5
    assert open(tmp_path / "ck" / "latest_checkpointed_iteration.txt").read().strip() == "5"
    assert not [d for d in os.listdir(tmp_path / "ck") if d.endswith(".tmp")]
    second, proc = run_engine(tmp_path / "second", nproc, *ten, *extra, "--load", str(tmp_path / "ck"),
                              "--save", str(tmp_path / "ck"))
    assert "loaded checkpoint" in proc.stdout
    resumed = train_losses(first) + train_losses(second)
    assert resumed == pytest.approx(train_losses(straight), rel=1e-6)
    assert [x["lr"] for x in second if "lr" in x] == pytest.approx([x["lr"] for x in straight if "lr" in x][5:])
    a = full_weights(str(tmp_path / "straight" / "ckpt" / "iter_0000010"))
    b = full_weights(str(tmp_path / "ck" / "iter_0000010"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6)


def test_reshard_tp2_to_tp1_and_tp2pp2(tmp_path):
    saved, _ = run_engine(tmp_path / "tp2", 2, "--tensor-model-parallel-size", "2", "--save", str(tmp_path / "ck"))
    want = [x["valid_loss"] for x in saved if "valid_loss" in x][-1]
    for name, nproc, layout in [("tp1", 1, []), ("tp2pp2", 4, ["--tensor-model-parallel-size", "2",
                                                               "--pipeline-model-parallel-size", "2"])]:
        lines, proc = run_engine(tmp_path / name, nproc, *layout, "--load", str(tmp_path / "ck"), "--skip-train")
        assert "weights resharded" in proc.stdout, proc.stdout[-2000:]
        got = [x["valid_loss"] for x in lines if "valid_loss" in x][-1]
        assert got == pytest.approx(want, rel=1e-5), name


def test_missing_checkpoint_starts_fresh_and_bad_tracker_fails(tmp_path):
    lines, proc = run_engine(tmp_path / "a", 1, "--train-iters", "1", "--load", str(tmp_path / "none"))
    assert "starting from scratch" in proc.stdout and len(train_losses(lines)) == 1
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "latest_checkpointed_iteration.txt").write_text("release\n")
    _, proc = run_engine(tmp_path / "b", 1, "--train-iters", "1", "--load", str(tmp_path / "bad"), check=False)
    assert proc.returncode != 0 and "expected an iteration number" in proc.stderr
