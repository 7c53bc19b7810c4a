"""Acceleration switches change how the step is computed, not what it computes; divergence is caught."""
import pytest

from engine_utils import run_engine, train_losses


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    lines, _ = run_engine(tmp_path_factory.mktemp("plain"), 1)
    return train_losses(lines)


@pytest.mark.parametrize("args", [["--checkpoint-activations"], ["--recompute-granularity", "selective"],
                                  ["--recompute-granularity", "full", "--recompute-method", "block",
                                   "--recompute-num-layers", "2"]],
                         ids=["checkpoint_activations", "selective", "full_block"])
def test_activation_recompute_gives_the_same_losses(tmp_path, plain, args):
    lines, _ = run_engine(tmp_path, 1, *args)
    assert train_losses(lines) == pytest.approx(plain, rel=1e-6)


def test_lamb_optimizer_trains(tmp_path, plain):
    lines, proc = run_engine(tmp_path, 1, "--optimizers", "apex_lamb", "--lr", "1e-2", "--train-iters", "10")
    losses = train_losses(lines)
    assert "optimizer: LAMB" in proc.stdout or "optimizer: apex FusedLAMB" in proc.stdout
    assert losses[0] == pytest.approx(plain[0], rel=1e-6) and losses[-1] < losses[0] - 0.05


def test_divergence_is_reported_with_the_iteration(tmp_path):
    lines, proc = run_engine(tmp_path, 1, "--lr", "1e4", "--clip-grad", "0", "--train-iters", "30", check=False)
    assert proc.returncode != 0
    assert "loss is nan at iteration" in proc.stdout or "loss is inf at iteration" in proc.stdout
    assert "--no-exit-on-nan" in proc.stderr


def test_fp16_dynamic_loss_scaling(tmp_path, plain):
    # The default initial scale (2**32) overflows on the first steps: they are skipped, the scale halves.
    lines, proc = run_engine(tmp_path, 1, "--fp16", "--train-iters", "5")
    assert "step skipped (inf/nan grads, loss scale lowered)" in proc.stdout
    assert [x["skipped"] for x in lines if "skipped" in x][0] == 1.0
    lines, _ = run_engine(tmp_path / "small", 1, "--mixed-precision", "--initial-loss-scale", "1024")
    losses = train_losses(lines)
    assert not any(x["skipped"] for x in lines if "skipped" in x)
    assert losses == pytest.approx(plain, rel=5e-3)  # fp16 weights and activations against fp32
