"""Each parallel layout trains exactly like the single-process run: same losses, same gradient norm at every
step, same weights after 5 steps.

Several CPU processes with gloo (megatron-core on the CPU backend), a tiny fp32 GPT started from the same
weights in every layout (--init-layout-invariant), the same global batches.

Adam (m / sqrt(v) per element) and clipping (division by the global norm) cancel a constant factor on the
gradients, so losses and weights alone do not see gradients summed instead of averaged over DP, a missing
1/num_microbatches, or a tied embedding's gradient counted twice: the gradient norm does. One layout also
runs without clipping and with an Adam epsilon far above every |gradient| (update ~ lr * m / eps, a
momentum SGD), so such an error also reaches the weights and the losses.
"""
import os

import pytest

from engine_utils import assert_trains_like, full_weights, per_iteration, run_engine

# optimizer settings of a reference run -> extra flags
SETTINGS = {
    "default": [],  # Adam, --clip-grad 1 (the grad norm is about 1.5: clipping is active)
    "scale_sensitive": ["--clip-grad", "0", "--adam-eps", "1", "--lr", "0.1"],
}

LAYOUTS = {  # name -> (processes, flags, settings)
    "tp2": (2, ["--tensor-model-parallel-size", "2"], "default"),
    # sequence parallelism on the CPU backend (compat: cuda_device_arguments_to_cpu_in_backward)
    "tp2_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"], "default"),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"], "default"),
    "pp2_vpp2": (2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"], "default"),
    "dp2": (2, [], "default"),
    "dp2_zero1": (2, ["--zero-1-memory-optimization"], "default"),
    "dp2_zero2": (2, ["--zero-2-memory-optimization"], "default"),
    "tp2_dp2_zero2": (4, ["--tensor-model-parallel-size", "2", "--zero-2-memory-optimization"], "default"),
    # PP with ZeRO-2 exercises megatron_patch.compat.megatron_fsdp's fixes (mesh, tied embedding grads).
    "pp2_dp2_zero2": (4, ["--pipeline-model-parallel-size", "2", "--zero-2-memory-optimization"], "default"),
    # TP and PP (tied embedding) with several micro batches, where a gradient scale error moves the weights.
    "tp2_pp2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], "scale_sensitive"),
    # TP, PP (tied embedding), DP and 2 micro batches at once, where a gradient scale error moves the weights.
    "tp2_pp2_dp2_zero1": (8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                              "--zero-1-memory-optimization"], "scale_sensitive"),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory, tiny_reference):
    """settings -> (metrics lines, weights) of the single-process run; each run once, when first needed (the
    default one is the session's tiny_reference, shared with test_engine_switches)."""
    runs = {}

    def get(settings):
        if settings not in runs:
            if settings == "default":
                lines, ckpt = tiny_reference
            else:
                d = tmp_path_factory.mktemp(settings)
                ckpt = str(d / "ckpt")
                lines, _ = run_engine(d, 1, *SETTINGS[settings], "--save", ckpt)
            runs[settings] = lines, full_weights(os.path.join(ckpt, "iter_0000005"))
        return runs[settings]

    return get


# Slow for CI time (make test-all runs them); each property stays in the default lane through another layout:
# tp2 and tp2_pp2 (TP2: the MoE tp2_ep2, the PreTrainer parity test at TP2, test_engine_checkpoint's TP2 resume;
# PP with several micro batches: pp2_vpp2), pp2 (in pp2_vpp2, tp2_pp2), tp2_dp2_zero2
# (TP2 + ZeRO-2 is in the PreTrainer parity test), dp2 (DP: dp2_zero1), pp2_dp2_zero2 (PP + ZeRO-2: test_pretrainer's
# TP2 x PP2 ZeRO-2 run against the engine), tp2_pp2_dp2_zero1 (8 processes, about a minute: TP x PP in tp2_pp2,
# DP x ZeRO-1 in dp2_zero1).
SLOW = ("tp2", "tp2_sp", "pp2", "tp2_dp2_zero2", "dp2", "pp2_dp2_zero2", "tp2_pp2_dp2_zero1", "tp2_pp2")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow if n in SLOW else ()) for n in LAYOUTS])
def test_layout_matches_single_process(name, references, tmp_path):
    nproc, args, settings = LAYOUTS[name]
    lines, _ = run_engine(tmp_path, nproc, *args, *SETTINGS[settings], "--save", str(tmp_path / "ckpt"), torchrun=False)
    assert_trains_like(references(settings), lines, full_weights(str(tmp_path / "ckpt" / "iter_0000005")))


# scale_sensitive: slow (CI time). The default settings' run sees a wrong scale too: the gradient norms are compared
# (a lost 1/4 shows as a 4x norm, and a reported loss divided twice as a wrong loss), with clipping active
@pytest.mark.parametrize("settings", [pytest.param(s, marks=pytest.mark.slow if s == "scale_sensitive" else ())
                                      for s in SETTINGS])
def test_one_micro_batch_trains_like_four(settings, references, tmp_path):
    """The 1/num-micro-batches scale of the loss, where no layout test sees it (their references accumulate as many
    micro batches as they do): the global batch of 8 as one micro batch of 8 trains like the reference's 4 micro
    batches of 2 (the same samples). With the default settings clipping is active (grad norm above --clip-grad 1)
    and the norms are compared; with scale_sensitive a scale error also moves the weights. (One process, 5
    iterations: about 15 s each; the references are shared with the layout tests.)"""
    ref_lines, _ = references(settings)
    if settings == "default":
        assert min(per_iteration(ref_lines, "grad_norm")) > 1.0  # clipping is active at every step
    lines, proc = run_engine(tmp_path, 1, *SETTINGS[settings], "--micro-batch-size", "8", "--save", str(tmp_path / "ck"))
    assert "micro batch 8 x 1 accumulation" in proc.stdout  # the reference runs micro batch 2 x 4
    assert_trains_like(references(settings), lines, full_weights(str(tmp_path / "ck" / "iter_0000005")))
