"""The GPU lane (`make test-gpu`, one CUDA GPU): bf16, --compile, ZeRO-1/2, --cpu-offload and resume give
the results of the plain run, within the tolerance of each kernel path. Skipped, with the reason, without CUDA."""
import pytest

from engine_utils import full_weights, run_engine, train_losses

pytestmark = pytest.mark.gpu

GPU = ["--train-iters", "20", "--lr", "1e-3", "--hidden-size", "256", "--seq-length", "128", "--eval-interval", "10"]


def close(a, b, rel):
    assert len(a) == len(b) and a, (a, b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x == pytest.approx(y, rel=rel), f"iteration {i + 1}: {x} vs {y}\n{a}\n{b}"


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    lines, _ = run_engine(tmp_path_factory.mktemp("fp32"), 1, *GPU)
    return train_losses(lines)


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    lines, proc = run_engine(tmp_path_factory.mktemp("bf16"), 1, *GPU, "--bf16")
    return lines, proc


def test_bf16_learns_and_tracks_fp32(fp32, bf16):
    lines, proc = bf16
    losses = train_losses(lines)
    assert losses[-1] < losses[0] - 0.3
    close(losses, fp32, rel=2e-2)  # bf16 activations against fp32: measured gap below 0.5%
    assert "MFU" in proc.stdout and "mem" in proc.stdout  # the log line knows the GPU's peak


def test_compile_matches_eager(tmp_path, bf16):
    lines, proc = run_engine(tmp_path, 1, *GPU, "--bf16", "--compile")
    close(train_losses(lines), train_losses(bf16[0]), rel=1e-2)


@pytest.mark.parametrize("zero", ["--zero-1-memory-optimization", "--zero-2-memory-optimization"], ids=["zero1", "zero2"])
def test_zero_matches_plain(tmp_path, bf16, zero):
    lines, _ = run_engine(tmp_path, 1, *GPU, "--bf16", zero)
    close(train_losses(lines), train_losses(bf16[0]), rel=2e-3)


def test_cpu_offload_matches_and_saves_gpu_memory(tmp_path):
    base, _ = run_engine(tmp_path / "gpu", 1, *GPU, "--bf16", "--zero-1-memory-optimization")
    off, proc = run_engine(tmp_path / "off", 1, *GPU, "--bf16", "--zero-1-memory-optimization", "--cpu-offload")
    assert "offloaded to the CPU" in proc.stdout
    close(train_losses(off), train_losses(base), rel=2e-3)
    peak = lambda lines: max(x["max_memory_bytes"] for x in lines if "max_memory_bytes" in x)  # noqa: E731
    assert peak(off) < peak(base)


@pytest.mark.parametrize("extra,rel", [([], 1e-5), (["--bf16", "--zero-2-memory-optimization"], 2e-3)],
                         ids=["fp32", "bf16_zero2"])
def test_resume_with_dropout(tmp_path, extra, rel):
    ten = ["--train-iters", "10", "--eval-interval", "5", "--hidden-dropout", "0.1", "--attention-dropout", "0.1", *extra]
    straight, _ = run_engine(tmp_path / "s", 1, *ten, "--save", str(tmp_path / "s" / "ck"))
    first, _ = run_engine(tmp_path / "a", 1, *ten, "--exit-interval", "5", "--save", str(tmp_path / "ck"))
    second, _ = run_engine(tmp_path / "b", 1, *ten, "--load", str(tmp_path / "ck"), "--save", str(tmp_path / "ck"))
    close(train_losses(first) + train_losses(second), train_losses(straight), rel=rel)
    if not extra:
        a = full_weights(str(tmp_path / "s" / "ck" / "iter_0000010"))
        b = full_weights(str(tmp_path / "ck" / "iter_0000010"))
        for k in a:
            assert (a[k] - b[k]).abs().max() < 1e-5, k


def test_moe_bf16_tracks_fp32(tmp_path):
    """MoE on the GPU (router counts reduced over NCCL, experts as SequentialMLP): bf16 follows fp32."""
    moe = [*GPU, "--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear", "--moe-aux-loss-coeff", "0.01"]
    ref, _ = run_engine(tmp_path / "fp32", 1, *moe)
    lines, _ = run_engine(tmp_path / "bf16", 1, *moe, "--bf16")
    close(train_losses(lines), train_losses(ref), rel=2e-2)
    assert train_losses(lines)[-1] < train_losses(lines)[0] - 0.3
    assert all(sum(layer) == 8 * 128 * 2 for x in lines if "moe_tokens_per_expert" in x for layer in x["moe_tokens_per_expert"])
