"""Acceleration switches change how the step is computed, not what it computes; divergence is caught."""
import math

import pytest

from engine_utils import (
    full_weights, per_iteration, run_counting_forwards, run_counting_forwards_together, run_engine,
    run_engines_in_one_process, train_losses,
)

# TINY trains 5 iterations of 4 micro batches (global batch 8, micro batch 2, one process), 4 layers.
MICRO_BATCHES = 5 * 4
LAYERS = range(1, 5)


@pytest.fixture(scope="module")
def plain(tiny_reference):
    """The losses of TINY on one process without any switch (the session's run, shared with test_engine_parallel)."""
    return train_losses(tiny_reference[0])


# flags -> (layers whose whole forward is recomputed, layers whose core attention alone is recomputed)
RECOMPUTE = {
    "checkpoint_activations": (["--checkpoint-activations"], set(LAYERS), set()),  # full, uniform, 1 layer a unit
    "selective": (["--recompute-granularity", "selective"], set(), set(LAYERS)),
    "full_block": (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2"],
                   {1, 2}, set()),
}


# test_deferred_step_metrics_record_what_immediate_ones_do: 7 iterations that log, evaluate and save at other steps
DEFERRED = ["--train-iters", "7", "--log-interval", "5", "--eval-interval", "3", "--save-interval", "4"]


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    """The counting runs of this module (each recompute setting, and the fp32 deferred-metrics run with its
    checkpoints in DIR/deferred_ckpt), one after another in one process: (DIR, name -> (lines, forward calls))."""
    d = tmp_path_factory.mktemp("counted")
    runs = {name: flags for name, (flags, _, _) in RECOMPUTE.items()}
    runs["deferred"] = [*DEFERRED, "--save", str(d / "deferred_ckpt")]
    return d, run_counting_forwards_together(d, runs)


@pytest.mark.parametrize("name", list(RECOMPUTE))
def test_activation_recompute_reruns_the_forward_and_gives_the_same_losses(counted, plain, name):
    """Recomputation runs a module's forward a second time in the backward pass; counting forward calls
    proves it happens (and where), which equal losses alone cannot."""
    _, full, attention_only = RECOMPUTE[name]
    lines, calls = counted[1][name]
    expected = {}
    for n in LAYERS:
        expected[f"layer {n}"] = MICRO_BATCHES * (2 if n in full else 1)
        expected[f"core_attention {n}"] = MICRO_BATCHES * (2 if n in full or n in attention_only else 1)
    assert calls == expected
    assert train_losses(lines) == pytest.approx(plain, rel=1e-6)


def test_lamb_optimizer_takes_lamb_steps_and_learns(tmp_path, plain):
    """LAMB moves every tensor by exactly lr * ||p|| (the trust ratio ||p|| / ||r|| scales the update r
    to the weight's norm); Adam moves each element by about lr, so its tensors move by about lr * sqrt(n),
    about 30x more here. Checked on the saved weights of consecutive steps, so it holds for what the engine
    actually applied."""
    ckpt = tmp_path / "ckpt"
    lines, proc = run_engine(tmp_path, 1, "--optimizers", "apex_lamb", "--lr", "1e-2", "--train-iters", "6",
                             "--save", str(ckpt), "--save-interval", "1")
    assert "optimizer: LAMB" in proc.stdout or "optimizer: apex FusedLAMB" in proc.stdout
    losses, lrs = train_losses(lines), per_iteration(lines, "lr")
    assert losses[0] == pytest.approx(plain[0], rel=1e-6)  # same start as Adam: only the updates differ
    before = full_weights(str(ckpt / "iter_0000001"))
    for step in range(2, 7):  # step 1 starts from zero biases, where the trust ratio is 1 by definition
        after = full_weights(str(ckpt / f"iter_{step:07d}"))
        for k, p in before.items():
            moved = (after[k].double() - p.double()).norm().item()
            assert moved == pytest.approx(lrs[step - 1] * p.double().norm().item(), rel=1e-3), (step, k)
        before = after
    assert losses[-1] < losses[0] - 0.02  # and it learns (measured: 4.857 -> 4.812 in 6 steps)


def test_divergence_is_reported_with_the_iteration(tmp_path):
    lines, proc = run_engine(tmp_path, 1, "--lr", "1e4", "--clip-grad", "0", "--train-iters", "30", check=False)
    assert proc.returncode != 0
    assert "loss is nan at iteration" in proc.stdout or "loss is inf at iteration" in proc.stdout
    assert "--no-exit-on-nan" in proc.stderr


def expected_loss_scales(skipped, initial=2.0**32, hysteresis=2, backoff=0.5, growth=2.0, growth_interval=1000,
                         min_scale=1.0):
    """megatron-core's DynamicGradScaler.update with the OptimizerConfig defaults the engine keeps
    (hysteresis 2, loss_scale_window 1000, min_loss_scale 1; backoff 0.5 and growth 2 are fixed)."""
    scale, tracker, good, out = initial, hysteresis, 0, []
    for s in skipped:
        if s:
            good, tracker = 0, tracker - 1
            if tracker <= 0:
                scale = max(scale * backoff, min_scale)
        else:
            good += 1
            if good == growth_interval:
                good, tracker, scale = 0, hysteresis, scale * growth
        out.append(scale)
    return out


def test_fp16_dynamic_loss_scaling(tmp_path, plain):
    """The rule megatron-core applies is not "halve on every skipped step": with hysteresis 2 the first
    overflow only uses up one unit of hysteresis (the scale stays 2**32), and every later overflow halves
    it, because the hysteresis count is restored only when the scale grows (after 1000 clean steps), not by
    one clean step. Without overflow the scale stays put. A skipped step does not advance the lr schedule.

    From 2**32 the tiny model overflows for 14 steps (down to 2**19), then trains."""
    iters = 20
    # with the run of the scale that never overflows (below), one after the other in one process (CI time)
    runs, _ = run_engines_in_one_process(tmp_path, {
        "overflows": ["--fp16", "--train-iters", str(iters), "--eval-interval", "100"],
        "small": ["--mixed-precision", "--initial-loss-scale", "1024"]})
    lines = runs["overflows"]
    skipped = [bool(s) for s in per_iteration(lines, "skipped")]
    assert skipped[0] and skipped[1] and not skipped[-1]
    assert per_iteration(lines, "loss_scale") == expected_loss_scales(skipped)
    # Linear decay from --lr 1e-4 to 0 over the run, counted in applied steps only.
    applied = 0
    for lr, s in zip(per_iteration(lines, "lr"), skipped):
        assert lr == pytest.approx(1e-4 * (1 - applied / iters), rel=1e-9)
        applied += not s
    norms = per_iteration(lines, "grad_norm")
    assert all(math.isfinite(n) != s for n, s in zip(norms, skipped))  # inf/nan grads <=> skipped

    # A scale that never overflows: the same 5 steps as fp32, within fp16 rounding (measured gap 2.2e-5).
    lines = runs["small"]
    assert per_iteration(lines, "loss_scale") == [1024.0] * 5
    assert not any(per_iteration(lines, "skipped"))
    assert train_losses(lines) == pytest.approx(plain, rel=1e-4)


@pytest.mark.slow  # about a minute on 2 cores: inductor compiles the layer graph once
@pytest.mark.parametrize("family,compiled", [("gpt", "4 transformer layers"), ("llama", "4 transformer layers"),
                                              ("qwen2", "4 transformer layers"), ("mistral", "4 transformer layers"),
                                              ("mixtral", "the attention of 4 MoE layers"),
                                              ("qwen2_moe", "the attention of 4 MoE layers")])
def test_compile_builds_one_graph_for_all_layers_and_matches_eager(tmp_path, family, compiled):
    """--compile compiles each transformer layer (MoE layers: their attention): one graph serves all four layers
    (no graph break, no recompilation after the first step), and the losses are eager's within fp32
    reduction-order noise."""
    eager, _ = run_engine(tmp_path / "eager", 1, "--model-family", family, "--eval-iters", "0")
    lines, proc = run_engine(tmp_path / "compiled", 1, "--model-family", family, "--eval-iters", "0", "--compile")
    assert f"torch.compile: {compiled} compiled" in proc.stdout
    graphs = per_iteration(lines, "compiled_graphs")
    assert graphs == [1] * len(graphs), graphs
    assert train_losses(lines) == pytest.approx(train_losses(eager), rel=1e-5)


@pytest.mark.parametrize("precision", [[], pytest.param(["--fp16"], marks=pytest.mark.slow)],  # slow: CI time
                         ids=["fp32", "fp16"])  # fp16: a loss scale that moves
def test_deferred_step_metrics_record_what_immediate_ones_do(tmp_path, precision, request):
    """On a GPU the loop reads a step's metrics only once the next step is queued (no host synchronisation
    between steps); iterations that log, evaluate or save are finished at once. The same run with deferred
    metrics (forced on here, on the CPU) writes the same records in the same order, and saves the same
    checkpoints, as the run that finishes every step at once. (fp32: the deferred run is one of `counted`.)"""
    args = [*DEFERRED, *precision]
    now, _ = run_engine(tmp_path / "now", 1, *args, "--save", str(tmp_path / "now" / "ckpt"))
    if precision:
        deferred, _ = run_counting_forwards(tmp_path / "deferred", *args, "--save", str(tmp_path / "deferred_ckpt"))
        saved = tmp_path / "deferred_ckpt"
    else:
        d, runs = request.getfixturevalue("counted")
        deferred, saved = runs["deferred"][0], d / "deferred_ckpt"

    def records(lines):
        return [{k: v for k, v in x.items() if k not in ("step_time", "wall_time")} for x in lines]

    assert [x.get("iteration") for x in deferred] == [1, 2, 3, 3, 4, 5, 6, 6, 7]  # 3 and 6 twice: validation
    assert records(deferred) == records(now)
    assert all(x["step_time"] > 0 for x in deferred if "loss" in x)
    for it in (4, 7):
        assert (saved / f"iter_{it:07d}").is_dir()
