"""ZeRO-1 (megatron-core's distributed optimizer) divides optimizer state by the DP size; gradients stay whole.
ZeRO-2 (Megatron-FSDP, optim_grads) divides the gradient buffer too.

Adam with bf16 weights keeps 12 bytes per parameter of optimizer state (fp32 main weight + two fp32
moments): 12*N on every rank without ZeRO, 12*N/d with ZeRO-1 over d ranks. The fp32 gradient buffer
stays 4*N on every rank (that would be ZeRO-2's job).
"""
import pytest

from engine_utils import run_engine

ARGS = ["--train-iters", "1", "--bf16", "--eval-iters", "0", "--hidden-size", "128", "--num-layers", "2"]


def first(lines, key):
    return next(x[key] for x in lines if key in x)


# ZeRO-1 at DP2 with fp32 gradients, 6 iterations: the memory formula's ZeRO-1 case (read at the first iteration,
# which the longer run does not change) and the reference of --grad-reduce-in-bf16, one run for both
ZERO1_FP32_GRADS = [*ARGS, "--train-iters", "6", "--lr", "1e-3", "--zero-1-memory-optimization"]


@pytest.fixture(scope="module")
def zero1_fp32_grads(tmp_path_factory):
    lines, _ = run_engine(tmp_path_factory.mktemp("zero1_fp32_grads"), 2, *ZERO1_FP32_GRADS, torchrun=False)
    return lines


@pytest.mark.parametrize("zero", [0, 1, 2], ids=["plain", "zero1", "zero2"])
def test_optimizer_state_bytes_follow_formula(tmp_path, zero, request):
    if zero == 1:
        lines = request.getfixturevalue("zero1_fp32_grads")
    else:
        extra = [f"--zero-{zero}-memory-optimization"] if zero else []
        lines, _ = run_engine(tmp_path, 2, *ARGS, *extra, torchrun=False)
    n = first(lines, "num_params")
    d = 2 if zero else 1
    g = 2 if zero == 2 else 1
    opt, grads, weights = first(lines, "bytes_optimizer"), first(lines, "bytes_grads"), first(lines, "bytes_weights")
    # Buckets are padded so that every DP rank gets an equal, aligned shard: allow 1% or 64 KiB.
    assert opt == pytest.approx(12 * n / d, rel=0.01, abs=65536), (opt, n)
    assert grads == pytest.approx(4 * n / g, rel=0.01, abs=65536)
    if zero < 2:  # Megatron-FSDP keeps extra all-gather buffers for the weights; only ZeRO-3 shards them
        assert weights == pytest.approx(2 * n, rel=0.01, abs=65536)


def test_grad_reduce_in_bf16_halves_the_gradient_buffer_and_tracks_fp32(tmp_path, zero1_fp32_grads):
    """--grad-reduce-in-bf16: a bf16 gradient buffer (2 bytes per parameter instead of 4), reduced over DP in
    bf16; the losses follow the fp32-gradient run within bf16 rounding."""
    fp32 = zero1_fp32_grads
    bf16, proc = run_engine(tmp_path / "bf16", 2, *ZERO1_FP32_GRADS, "--grad-reduce-in-bf16", torchrun=False)
    assert "bf16 (bf16 gradients)" in proc.stdout
    n = first(bf16, "num_params")
    assert first(bf16, "bytes_grads") == pytest.approx(2 * n, rel=0.01, abs=65536)
    assert first(fp32, "bytes_grads") == pytest.approx(4 * n, rel=0.01, abs=65536)
    a, b = [x["loss"] for x in fp32 if "loss" in x], [x["loss"] for x in bf16 if "loss" in x]
    assert len(a) == 6 and a != b  # the gradients really were rounded
    assert b == pytest.approx(a, rel=1e-2)
