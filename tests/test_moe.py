"""Mixture of experts (megatron-core MoELayer, local spec) on the CPU backend: every expert-parallel layout
trains like the single process (same losses, gradient norms, aux losses, tokens per expert, final weights),
and the MoE settings megatron-core cannot run are refused in words.

A tiny fp32 GPT with 4 experts, top-2, in both layers, started from the same weights in every layout
(--init-layout-invariant seeds expert e of layer l by its global name, whichever EP rank holds it).
"""
import re
import shutil

import pytest
import torch

from engine_utils import full_weights, per_iteration, rewind_validation, run_engine, train_losses
from megatron_patch.config import ConfigError, parse_args

MOE = ["--num-layers", "2", "--lr", "1e-3", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "128",
       "--disable-bias-linear", "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001"]

LAYOUTS = {  # name -> (processes, flags)
    "ep2": (2, ["--expert-model-parallel-size", "2"]),
    "ep2_allgather": (2, ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "allgather"]),
    # DP 4, expert-DP 2: the distributed optimizer shards dense state over 4 ranks, expert state over 2.
    "ep2_dp4_zero1": (4, ["--expert-model-parallel-size", "2", "--zero-1-memory-optimization"]),
    # experts sliced over ETP 2 (the alltoall dispatcher's uneven all-gather over gloo), sequence parallel.
    "tp2_ep2": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2"]),
    "tp2_ep2_etp1_zero1": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                               "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
                               "--zero-1-memory-optimization"]),
    "pp2_ep2": (4, ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"]),
    # --moe-grouped-gemm: the experts as two torch._grouped_mm calls instead of megatron-core's SequentialMLP
    "grouped": (1, ["--moe-grouped-gemm"]),
    "ep2_grouped": (2, ["--expert-model-parallel-size", "2", "--moe-grouped-gemm"]),
    "tp2_ep2_etp1_zero1_grouped": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                       "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
                                       "--zero-1-memory-optimization", "--moe-grouped-gemm"]),
    # with the dense linears' weight gradients fused into the buffer; the grouped experts keep the usual hooks
    "grouped_wgrad_fusion": (1, ["--moe-grouped-gemm", "--gradient-accumulation-fusion"]),
}


def _model(weights):
    return {k: v for k, v in weights.items() if ".optimizer." not in k}  # ChainedOptimizer: chained_N.optimizer.*


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe_ep1")
    lines, _ = run_engine(d, 1, *MOE, "--save", str(d / "ckpt"), "--save-interval", "2")
    return lines, _model(full_weights(str(d / "ckpt" / "iter_0000005"))), d / "ckpt"


# The rest run in `make test-all` (CI time). ep2_grouped is the default lane's EP2 layout: the alltoall dispatch, the
# expert-DP gradients and the experts' global names on EP rank 1 (layout-invariant init, the checkpoint) are ep2's (the
# grouped experts keep SequentialMLP's parameters; plant guards/ep-rank-experts-numbered-locally), and it is the one
# guard of the grouped path's local expert order on an EP rank other than 0 (about 8 s of CPU, mostly start-up). ep2
# adds megatron-core's own SequentialMLP at EP2, whose forward at EP2 test_checkpoint_reshards_experts and
# test_conversion_today's DeepSeek-V2 at EP2 run. EP1 grouped numerics stay guarded by grouped_wgrad_fusion and
# test_resume_is_exact[grouped] (a grouped continuation of a sequential run).
FAST = ("ep2_grouped", "grouped_wgrad_fusion")


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in LAYOUTS])
def test_layout_matches_single_process(name, reference, tmp_path):
    nproc, args = LAYOUTS[name]
    ref_lines, ref_weights, _ = reference
    lines, proc = run_engine(tmp_path, nproc, *MOE, *args, "--save", str(tmp_path / "ckpt"), torchrun=False)
    if "--moe-grouped-gemm" in args:
        assert "MoE grouped GEMM: the experts of 2 MoE layers run as two torch._grouped_mm calls per layer" \
            in proc.stdout
        # at EP 1 the tokens are dispatched on the device (models/moe_dispatch.py), else by megatron-core
        local = nproc == 1 or "--expert-model-parallel-size" not in args
        assert f"MoE dispatch on the device: {2 if local else 0} MoE layers" in proc.stdout, proc.stdout
    if "--gradient-accumulation-fusion" in args:  # 2 layers x (QKV, projection) + output; 2 x 4 experts x 2
        assert ("gradient accumulation fusion: 5 linear layers" in proc.stdout
                and "16 expert linears run as grouped GEMMs" in proc.stdout), proc.stdout
    assert train_losses(lines) == pytest.approx(train_losses(ref_lines), rel=1e-5)
    assert train_losses(lines)[-1] < train_losses(lines)[0]
    for key in ("grad_norm", "moe_load_balancing_loss", "moe_z_loss"):
        assert per_iteration(lines, key) == pytest.approx(per_iteration(ref_lines, key), rel=1e-5), key
    assert per_iteration(lines, "moe_tokens_per_expert") == per_iteration(ref_lines, "moe_tokens_per_expert")
    weights = _model(full_weights(str(tmp_path / "ckpt" / "iter_0000005")))
    assert set(weights) == set(ref_weights)
    for k, w in ref_weights.items():
        torch.testing.assert_close(weights[k], w, rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def test_metrics_per_iteration(reference):
    lines = reference[0]
    tokens = per_iteration(lines, "moe_tokens_per_expert")
    # 8 sequences x 32 tokens x top-2 routed in each of the 2 MoE layers, every step.
    assert all(len(step) == 2 and all(sum(layer) == 8 * 32 * 2 for layer in step) for step in tokens)
    assert all(0.9 < x < 1.2 for x in per_iteration(lines, "moe_load_balancing_loss"))  # 1 = balanced
    assert all(x >= 1 for x in per_iteration(lines, "moe_max_load"))


def _resume(src, iteration, dst):
    """A copy of checkpoint directory `src` as it stood after saving `iteration`."""
    shutil.copytree(src, dst)
    (dst / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return dst


def _after(lines, start, key):
    return [x[key] for x in lines if "loss" in x and x["iteration"] > start]


def _assert_same_continuation(straight, resumed, start, rel=1e-6):
    assert len(_after(resumed, start, "loss")) == 5 - start
    for key in ("loss", "grad_norm", "moe_load_balancing_loss", "moe_z_loss", "lr"):
        assert _after(resumed, start, key) == pytest.approx(_after(straight, start, key), rel=rel), key
    assert _after(resumed, start, "moe_tokens_per_expert") == _after(straight, start, "moe_tokens_per_expert")


# sequential: slow (CI time); the grouped continuation loads the same checkpoint (the experts' parameters are
# SequentialMLP's) and must continue the sequential run as exactly, so it guards the MoE resume in the default lane
@pytest.mark.parametrize("extra", [pytest.param([], marks=pytest.mark.slow), ["--moe-grouped-gemm"]],
                         ids=["sequential", "grouped"])
def test_resume_is_exact(reference, tmp_path, extra):
    """EP1, stopped after iteration 2: the last 3 iterations (losses, aux losses, loads) as if never stopped;
    also when the resumed run computes the experts with grouped GEMMs (same parameters, same checkpoint)."""
    lines, _, ckpt = reference
    resumed, proc = run_engine(tmp_path, 1, *MOE, *extra, "--load", str(_resume(ckpt, 2, tmp_path / "ck")))
    assert "loaded checkpoint" in proc.stdout
    _assert_same_continuation(lines, resumed, 2, rel=1e-5 if extra else 1e-6)


def test_checkpoint_reshards_experts(reference, tmp_path):
    """Saved at EP1, loaded at EP2 (each rank takes its 2 of the 4 experts): the same validation loss as the EP1
    run's own evaluation at iteration 5 (after its last step, on the weights it saves there), on the same
    validation batches (the checkpoint's validation position rewound to them)."""
    lines, _, ckpt = reference
    ck = _resume(ckpt, 5, tmp_path / "ck")
    rewind_validation(ck / "iter_0000005")
    ep2, proc = run_engine(tmp_path / "ep2", 2, *MOE, "--expert-model-parallel-size", "2", "--load", str(ck),
                           "--skip-train", torchrun=False)
    assert "weights resharded" in proc.stdout
    saved = [x["valid_loss"] for x in lines if x.get("iteration") == 5 and "valid_loss" in x]
    assert len(saved) == 1 and ep2[-1]["valid_loss"] == pytest.approx(saved[0], rel=1e-6)


@pytest.mark.slow
def test_resume_at_ep2_is_exact(tmp_path):
    """EP2 with ZeRO-1 (a ChainedOptimizer: dense state sharded over DP, expert state over expert-DP): exact
    continuation after a stop (fails if a member's Adam step is not restored: compat.adam_state)."""
    args = [*MOE, "--expert-model-parallel-size", "2", "--zero-1-memory-optimization"]
    straight, _ = run_engine(tmp_path / "s", 2, *args, "--save", str(tmp_path / "s" / "ck"), "--save-interval", "2")
    resumed, proc = run_engine(tmp_path / "r", 2, *args, "--load", str(_resume(tmp_path / "s" / "ck", 2, tmp_path / "ck")))
    assert "loaded checkpoint" in proc.stdout and "start fresh" not in proc.stdout
    _assert_same_continuation(straight, resumed, 2)


BASE = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]


@pytest.mark.parametrize("extra,world,match", [
    (["--num-experts", "4", "--tensor-model-parallel-size", "2", "--sequence-parallel"], 2,
     "megatron-core supports expert biases only at --expert-tensor-parallel-size 1 (it is 2"),
    (["--num-experts", "3", "--expert-model-parallel-size", "2", "--disable-bias-linear"], 2, "not divisible by --expert-model-parallel-size 2"),
    (["--num-experts", "4", "--expert-model-parallel-size", "4", "--disable-bias-linear"], 2, "world size 2 is not divisible by --expert-tensor-parallel-size 1 x --expert-model-parallel-size 4"),
    (["--num-experts", "4", "--tensor-model-parallel-size", "2", "--disable-bias-linear"], 2, "needs --sequence-parallel"),
    (["--num-experts", "4", "--moe-router-topk", "1", "--disable-bias-linear"], 1, "needs --moe-router-pre-softmax"),
    (["--num-experts", "4", "--moe-router-topk", "5", "--disable-bias-linear"], 1, "between 1 and --num-experts 4"),
    (["--num-experts", "4", "--moe-ffn-hidden-size", "65", "--tensor-model-parallel-size", "2", "--sequence-parallel",
      "--disable-bias-linear"], 2, "not divisible by --expert-tensor-parallel-size 2"),
    (["--num-experts", "4", "--moe-pad-expert-input-to-capacity", "--disable-bias-linear"], 1, "needs --moe-expert-capacity-factor"),
    (["--num-experts", "4", "--expert-model-parallel-size", "2", "--zero-2-memory-optimization", "--disable-bias-linear"], 2,
     "use --zero-1-memory-optimization"),
    (["--expert-model-parallel-size", "2"], 2, "need --num-experts"),
    (["--moe-grouped-gemm"], 1, "--moe-grouped-gemm groups the GEMMs of an MoE layer's experts: it needs --num-experts"),
    (["--num-experts", "4", "--moe-grouped-gemm", "--tensor-model-parallel-size", "2", "--sequence-parallel",
      "--disable-bias-linear"], 2, "pass --expert-tensor-parallel-size 1"),
    (["--num-experts", "4", "--moe-grouped-gemm", "--zero-2-memory-optimization", "--disable-bias-linear"], 2,
     "--moe-grouped-gemm reads the experts' weights directly"),
    (["--num-experts", "4", "--moe-grouped-gemm", "--moe-ffn-hidden-size", "50", "--disable-bias-linear"], 1,
     "experts' hidden size (50, --moe-ffn-hidden-size) must be multiples of 8"),
])
def test_moe_rejections(extra, world, match):
    with pytest.raises(ConfigError, match=re.escape(match)):
        parse_args(BASE + extra).validate(world)


def test_expert_data_parallel_size():
    c = parse_args(BASE + ["--num-experts", "4", "--disable-bias-linear", "--tensor-model-parallel-size", "2",
                           "--sequence-parallel", "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"])
    v = c.validate(8)  # a resolved copy: the Config is frozen
    assert v.expert_data_parallel_size == 4 and v.data_parallel_size == 4


def test_metric_tensors_exist_before_the_first_step():
    """MoEMetrics creates the routers' tracked losses and its token counts before any forward, with addresses marked
    static: under CUDA graphs (--compile-mode reduce-overhead) a tensor first created inside a graph is its output,
    and the next step's in-place add into it fails."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from megatron_patch.training.moe_metrics import MoEMetrics

    cfg = parse_args(BASE + ["--num-experts", "4", "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001"])
    tracker = get_moe_metrics_tracker()
    tracker._metrics.clear()
    metrics = MoEMetrics(cfg, [])
    for name in ("load_balancing_loss", "z_loss"):
        values = tracker._metrics[name].values
        assert values.shape == (cfg.num_layers,) and getattr(values, "_dynamo_static_input_type", None)
    assert getattr(metrics.counts, "_dynamo_static_input_type", None)
    tracker._metrics.clear()
