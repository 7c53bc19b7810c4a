"""Each parallel layout trains exactly like the single-process run: same losses, same weights after 5 steps.

Several CPU processes with gloo (megatron-core on the CPU backend), a tiny fp32 GPT started from the same
weights in every layout (--init-layout-invariant), the same global batches.
"""
import pytest
import torch

from engine_utils import full_weights, run_engine, train_losses

LAYOUTS = {
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "pp2_vpp2": (2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]),
    "dp2_zero1": (2, ["--zero-1-memory-optimization"]),
    "dp2_zero2": (2, ["--zero-2-memory-optimization"]),
    "tp2_dp2_zero2": (4, ["--tensor-model-parallel-size", "2", "--zero-2-memory-optimization"]),
    # PP with ZeRO-2 exercises megatron_patch.parallel.megatron_fsdp_fixes (mesh, tied embedding grads).
    "pp2_dp2_zero2": (4, ["--pipeline-model-parallel-size", "2", "--zero-2-memory-optimization"]),
    "tp2_pp2_dp2_zero1": (8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                              "--zero-1-memory-optimization"]),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("single")
    lines, _ = run_engine(d, 1, "--save", str(d / "ckpt"))
    return train_losses(lines), full_weights(str(d / "ckpt" / "iter_0000005"))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, reference, tmp_path):
    ref_losses, ref_weights = reference
    nproc, args = LAYOUTS[name]
    lines, _ = run_engine(tmp_path, nproc, *args, "--save", str(tmp_path / "ckpt"))
    losses = train_losses(lines)
    assert len(losses) == len(ref_losses) == 5
    assert losses[-1] < losses[0]  # it learns
    for got, want in zip(losses, ref_losses):
        assert got == pytest.approx(want, rel=1e-5), (losses, ref_losses)
    weights = full_weights(str(tmp_path / "ckpt" / "iter_0000005"))
    assert set(weights) == set(ref_weights)
    for k, w in ref_weights.items():
        torch.testing.assert_close(weights[k], w, rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
