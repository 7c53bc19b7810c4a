"""The planner's memory model (config/memory_model.py) against the engine's own count of model-state bytes on every
rank (training/memory.py, logged at the first iteration), for ten layouts of four processes; and the planner's
command line."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine_utils import ROOT, TINY, run_engines_in_one_launch

from megatron_patch.config import parse_args
from megatron_patch.config.memory_model import rank_state_bytes

ONE_STEP = ["--train-iters", "1", "--eval-iters", "0"]
MOE = ["--model-family", "mixtral", "--num-experts", "4", "--moe-router-topk", "2"]
LLAMA = ["--model-family", "llama3", "--num-query-groups", "2"]

# ten layouts of 4 processes: ZeRO-0/1/2, TP (with sequence parallelism), PP (the tied embedding's own bucket),
# VPP, EP (the experts' buffers over the expert data-parallel group), bf16 and fp32
LAYOUTS = {
    "dp4_zero0_fp32": [],
    "dp4_zero1_bf16_gqa": [*LLAMA, "--zero-1-memory-optimization", "--bf16"],
    "dp4_zero2_bf16": [*LLAMA, "--zero-2-memory-optimization", "--bf16"],
    "tp2_dp2_zero1_sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--zero-1-memory-optimization",
                         "--bf16"],
    "pp2_dp2_zero1_untied": [*LLAMA, "--pipeline-model-parallel-size", "2", "--zero-1-memory-optimization"],
    "tp2_pp2_zero0": [*LLAMA, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
    # hidden 72: tensors that are not multiples of 64 elements, so ZeRO-1's alignment and bucket ends show
    "pp2_vpp2_dp2_zero1_tied": ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
                                "1", "--zero-1-memory-optimization", "--bf16", "--hidden-size", "72"],
    "ep2_dp4_zero1": [*MOE, "--expert-model-parallel-size", "2", "--zero-1-memory-optimization", "--bf16"],
    "ep4_zero0": [*MOE, "--expert-model-parallel-size", "4"],
    "tp2_dp2_zero2": [*LLAMA, "--tensor-model-parallel-size", "2", "--zero-2-memory-optimization"],
}
# the default lane: every rule at least once (ZeRO-0/1/2, TP, PP with the tied embedding's own bucket, VPP, EP)
DEFAULT = ("dp4_zero2_bf16", "pp2_vpp2_dp2_zero1_tied", "ep2_dp4_zero1", "tp2_pp2_zero0")


def _check(lines, flags, name):
    first = lines[0]
    measured = first["bytes_per_rank"]
    cfg = parse_args([*TINY, *flags, *ONE_STEP])
    predicted = [list(rank_state_bytes(cfg, first["vocab_size"], 4, r).as_dict().values()) for r in range(4)]
    assert predicted == measured, f"{name}: predicted (weights, grads, optimizer) per rank {predicted}, the engine {measured}"


def _run(tmp_path, names):
    runs = {n: [*LAYOUTS[n], *ONE_STEP] for n in names}
    out = run_engines_in_one_launch(tmp_path, 4, runs)
    for n in names:
        _check(out[n], runs[n], n)
    return out


def test_model_state_bytes_exact_on_every_rank(tmp_path):
    out = _run(tmp_path, DEFAULT)
    # the layouts make the ranks differ: pipeline stages, and ZeRO shards with padding at a bucket's end
    assert len({tuple(r) for r in out["pp2_vpp2_dp2_zero1_tied"][0]["bytes_per_rank"]}) > 1
    assert len({tuple(r) for r in out["ep2_dp4_zero1"][0]["bytes_per_rank"]}) > 1


@pytest.mark.slow
def test_model_state_bytes_exact_ten_layouts(tmp_path):
    _run(tmp_path, [n for n in LAYOUTS if n not in DEFAULT])


def _plan(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plan_parallel.py"), *args],
                          capture_output=True, text=True, timeout=300)


def test_plan_ranks_layouts_that_fit():
    p = _plan("--model", "llama3-8b", "--gpus", "8", "--seq-length", "4096", "--global-batch-size", "64", "--top", "5")
    assert p.returncode == 0, p.stderr
    rows = [x for x in p.stdout.splitlines() if x.strip()[:1].isdigit() and "|" in x]
    assert len(rows) == 5
    steps = [float(r.split("|")[3].split()[0]) for r in rows]
    assert steps == sorted(steps)
    peaks = [float(r.split("|")[2].split()[2]) for r in rows]
    assert all(0 < x < 79.2 for x in peaks)
    assert "--tensor-model-parallel-size" in p.stdout


def test_plan_says_when_nothing_fits_and_refuses_unknown_models():
    p = _plan("--model", "llama3-70b", "--gpus", "1", "--seq-length", "4096", "--global-batch-size", "8")
    assert p.returncode == 1 and "no layout fits 1 x" in p.stdout
    p = _plan("--model", "llama9-1t", "--gpus", "8")
    assert p.returncode == 2 and "--model 'llama9-1t'" in p.stderr and "llama3-8b" in p.stderr


def test_engine_warns_before_a_run_that_will_not_fit():
    from megatron_patch.config.fit import fit_warning
    from megatron_patch.config.validate import resolve

    big = resolve(parse_args(["--model-family", "llama3", "--model-size", "8b", "--bf16", "--mock-data",
                              "--seq-length", "4096", "--micro-batch-size", "4", "--global-batch-size", "8"]), 1)
    line = fit_warning(big, 128256, 1, 85_032_878_080)
    assert line.startswith("warning: this run is predicted to need") and "rank 0" in line
    assert "--micro-batch-size" in line and "plan_parallel.py" in line
    # the same model fits eight GPUs with ZeRO-1 and full recompute at micro batch 1
    fits = resolve(big.replace(zero_stage=1, micro_batch_size=1, recompute_granularity="full",
                               tensor_model_parallel_size=2, sequence_parallel=True), 8)
    assert fit_warning(fits, 128256, 8, 85_032_878_080) is None


def test_run_gpt_plan_prints_the_layout_of_its_flags():
    env = dict(os.environ, MODEL_FAMILY="llama3", MODEL_SIZE="8b", GPUS="8", TP="2", OUTPUT="/tmp/_plan_out_unused")
    p = subprocess.run(["bash", os.path.join(ROOT, "pretrain_scripts", "run_gpt.sh"), "--plan", "--bf16",
                        "--seq-length", "2048", "--global-batch-size", "64", "--micro-batch-size", "1",
                        "--sequence-parallel", "--zero-1-memory-optimization"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "this run's layout fits" in p.stdout
    assert "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --sequence-parallel " \
           "--zero-1-memory-optimization --micro-batch-size 1" in p.stdout


def test_activation_estimate_follows_recompute_and_the_schedule():
    from megatron_patch.config.activation_memory import activation_bytes
    from megatron_patch.config.validate import resolve

    base = ["--model-family", "llama3", "--model-size", "8b", "--bf16", "--mock-data", "--seq-length", "4096",
            "--micro-batch-size", "1", "--global-batch-size", "64"]
    plain = resolve(parse_args(base), 1)
    full = resolve(parse_args([*base, "--recompute-granularity", "full"]), 1)
    kept, kept_full = activation_bytes(plain, 128256).kept, activation_bytes(full, 128256).kept
    # full recompute keeps one hidden-size tensor per layer: 32 x 4096 tokens x 4096 x 2 bytes (+ the embedding's)
    assert kept_full == 33 * 4096 * 4096 * 2
    assert kept > 10 * kept_full
    # 1F1B: the first of 4 stages holds 4 micro batches, the last one
    pp = resolve(parse_args([*base, "--pipeline-model-parallel-size", "4"]), 4)
    first, last = activation_bytes(pp, 128256, 0).kept, activation_bytes(pp, 128256, 3).kept
    embedding = 4 * 4096 * 4096 * 2
    assert first - embedding == 4 * last


@pytest.mark.parametrize("dp", [2, 3, 8])
def test_zero1_buffer_layout_is_megatron_cores(dp):
    """memory_model.buffer_layout against megatron-core's own layout function (distributed optimizer), on a parameter
    list with sizes that are not multiples of 64 and a tied embedding (its own bucket): the same spans and buckets."""
    import torch
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from megatron_patch.config.memory_model import Param, buffer_layout

    class Fake:  # what the layout reads of a parameter: its element count and the shared_embedding mark
        def __init__(self, n, shared):
            self.data, self.shared_embedding = torch.empty(n), shared

    sizes = [(9216, True), (2304, False), (72, False), (15552, False), (72, False), (5184, False), (100, False)]
    ours, buckets = buffer_layout([Param(f"p{i}", n, shared_embedding=s) for i, (n, s) in enumerate(sizes)], dp, True)
    fakes = [Fake(n, s) for n, s in sizes]
    theirs = DistributedOptimizer._compute_per_buffer_param_layout(fakes, None, dp, DistributedDataParallelConfig())
    assert buckets == [tuple(b) for b in theirs.bucket_indices]
    assert ours == [tuple(theirs.param_index_map[f][:2]) for f in fakes]
    assert len(buckets) == 2  # the tied embedding apart


def test_plan_reads_a_hugging_face_model_directory(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
        "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 16, "vocab_size": 128256,
        "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": True,
        "hidden_act": "silu"}))
    p = _plan("--model", str(tmp_path), "--gpus", "8", "--seq-length", "4096", "--global-batch-size", "64", "--top", "2")
    assert p.returncode == 0, p.stderr
    assert "1.24B parameters, 16 layers, hidden 2048, vocabulary 128256" in p.stdout


def test_layer_time_is_a_fixed_cost_plus_a_rate():
    """layer_speed: a row fitted from two micro-batch sizes splits a layer's time into its rate and its fixed cost
    (the host launching kernels), and the planner's compute time adds the fixed cost once per layer and micro
    batch, a third of it per extra forward (full recompute)."""
    from megatron_patch.planning import layer_speed
    from megatron_patch.planning.hardware import GPUS
    from megatron_patch.planning.timing import layer_flops_per_token, step_time

    f = 3.0e7
    seconds = [0.002 + 3 * f * n / 300e12 for n in (8192, 16384)]  # 2 ms fixed, 300 TFLOP/s
    row = layer_speed.fit_row(f, (8192, 16384), tuple(seconds))
    assert row == (f, pytest.approx(300.0), pytest.approx(0.002))
    assert layer_speed.fit_row(f, (8192, 16384), (0.004, 0.004))[2] == 0.0  # noise: no fixed part, no crash
    argv = ["--model-family", "llama", "--num-layers", "4", "--hidden-size", "1024", "--ffn-hidden-size", "2816",
            "--num-attention-heads", "8", "--seq-length", "2048", "--micro-batch-size", "4",
            "--global-batch-size", "8", "--bf16"]
    g, key = GPUS["h100-80gb"], "h100-80gb"
    saved = layer_speed.MEASURED[key]
    try:
        fl = layer_flops_per_token(parse_args(argv), moe=False)
        layer_speed.MEASURED[key] = [(fl / 10, 300.0, 0.002), (fl * 10, 300.0, 0.002)]
        with_fixed = {r: step_time(parse_args([*argv, *r]), 32000, 1, g).compute
                      for r in ((), ("--recompute-granularity", "full"))}
        layer_speed.MEASURED[key] = [(fl / 10, 300.0), (fl * 10, 300.0)]
        without = {r: step_time(parse_args([*argv, *r]), 32000, 1, g).compute
                   for r in ((), ("--recompute-granularity", "full"))}
    finally:
        layer_speed.MEASURED[key] = saved
    # 4 layers x 2 micro batches: 8 x 2 ms, and 8 x 2 ms x 4/3 with full recompute's extra forward
    assert with_fixed[()] - without[()] == pytest.approx(8 * 0.002)
    full = ("--recompute-granularity", "full")
    assert with_fixed[full] - without[full] == pytest.approx(8 * 0.002 * 4 / 3)
