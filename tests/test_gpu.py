"""The GPU lane (`make test-gpu`, one CUDA GPU): bf16, --compile, ZeRO-1/2, --cpu-offload and resume give
the results of the plain run, within the tolerance of each kernel path. Skipped, with the reason, without CUDA."""
import pytest

from engine_utils import full_weights, per_iteration, run_engine, train_losses

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


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compile_matches_eager(tmp_path, bf16, mode):
    """--compile (and its CUDA-graph mode) trains like eager: same losses within bf16 noise, validation too."""
    lines, proc = run_engine(tmp_path, 1, *GPU, "--bf16", "--compile", "--compile-mode", mode)
    close(train_losses(lines), train_losses(bf16[0]), rel=1e-2)
    assert per_iteration(lines, "cudagraph_skips")[-1] == 0  # reduce-overhead: every layer graph is captured and replayed


def test_triton_cross_entropy_matches_plain_loss(tmp_path, bf16):
    """The fast configuration (--compile, CUDA graphs, Triton cross entropy) against the plain bf16 run."""
    lines, _ = run_engine(tmp_path, 1, *GPU, "--bf16", "--compile", "--compile-mode", "reduce-overhead",
                          "--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "triton")
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


@pytest.mark.parametrize("extra,rel", [([], 1e-5), (["--bf16", "--zero-2-memory-optimization"], 2e-3),
                                       (["--async-save"], 1e-5)], ids=["fp32", "bf16_zero2", "fp32_async_save"])
def test_resume_with_dropout(tmp_path, extra, rel):
    """Stopped at 5 and resumed: the uninterrupted run's losses and final weights; --async-save (the staging a
    device-to-host copy) writes the same checkpoint as a synchronous save."""
    ten = ["--train-iters", "10", "--eval-interval", "5", "--hidden-dropout", "0.1", "--attention-dropout", "0.1", *extra]
    straight, _ = run_engine(tmp_path / "s", 1, *ten, "--save", str(tmp_path / "s" / "ck"))
    first, _ = run_engine(tmp_path / "a", 1, *ten, "--exit-interval", "5", "--save", str(tmp_path / "ck"))
    second, _ = run_engine(tmp_path / "b", 1, *ten, "--load", str(tmp_path / "ck"), "--save", str(tmp_path / "ck"))
    close(train_losses(first) + train_losses(second), train_losses(straight), rel=rel)
    if "--bf16" not in extra:
        a = full_weights(str(tmp_path / "s" / "ck" / "iter_0000010"))
        b = full_weights(str(tmp_path / "ck" / "iter_0000010"))
        for k in a:
            assert (a[k] - b[k]).abs().max() < 1e-5, k


def test_moe_bf16_tracks_fp32(tmp_path):
    """MoE on the GPU (router counts reduced over NCCL, experts as SequentialMLP): bf16 follows fp32, and the
    grouped-GEMM experts follow SequentialMLP."""
    moe = [*GPU, "--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear", "--moe-aux-loss-coeff", "0.01"]
    ref, _ = run_engine(tmp_path / "fp32", 1, *moe)
    lines, _ = run_engine(tmp_path / "bf16", 1, *moe, "--bf16")
    close(train_losses(lines), train_losses(ref), rel=2e-2)
    assert train_losses(lines)[-1] < train_losses(lines)[0] - 0.3
    assert all(sum(layer) == 8 * 128 * 2 for x in lines if "moe_tokens_per_expert" in x for layer in x["moe_tokens_per_expert"])
    # --moe-grouped-gemm: the experts as torch._grouped_mm (one CUTLASS kernel on Hopper in bf16) against
    # SequentialMLP's per-expert cuBLAS GEMMs, both bf16: the same training within bf16 rounding.
    grouped, proc = run_engine(tmp_path / "grouped", 1, *moe, "--bf16", "--moe-grouped-gemm")
    assert "MoE grouped GEMM" in proc.stdout
    close(train_losses(grouped), train_losses(lines), rel=1e-2)
    assert [x["moe_tokens_per_expert"] for x in grouped if "moe_tokens_per_expert" in x][0] == \
        [x["moe_tokens_per_expert"] for x in lines if "moe_tokens_per_expert" in x][0]


def test_moe_layers_under_cuda_graphs(tmp_path):
    """--moe-grouped-gemm at EP 1 with --compile-mode reduce-overhead: the whole MoE layer (router, device dispatcher,
    grouped experts) replayed as CUDA graphs, none skipped, trains like eager, and the auxiliary loss the routers
    record inside the graphs is still reported (compat/moe.py tracker_tensors_before_capture)."""
    moe = [*GPU, "--bf16", "--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear",
           "--moe-aux-loss-coeff", "0.01", "--moe-grouped-gemm"]
    eager, _ = run_engine(tmp_path / "eager", 1, *moe)
    graphs, _ = run_engine(tmp_path / "graphs", 1, *moe, "--compile", "--compile-mode", "reduce-overhead")
    close(train_losses(graphs), train_losses(eager), rel=1e-2)
    assert per_iteration(graphs, "cudagraph_skips")[-1] == 0
    aux = [per_iteration(x, "moe_load_balancing_loss") for x in (eager, graphs)]
    assert aux[1] and all(v > 0 for v in aux[1])
    close(aux[1], aux[0], rel=2e-2)


TODAY = {  # today's families on the GPU: Llama 3.x RoPE scaling, Qwen3's q/k norms, DeepSeek's multi-latent attention
    "llama3": ["--model-family", "llama3", "--num-query-groups", "2"],
    "qwen3": ["--model-family", "qwen3", "--num-query-groups", "2", "--kv-channels", "96"],
    "deepseek_v2": ["--model-family", "deepseek_v2", "--model-size", "tiny", "--num-layers", "2", "--hidden-size", "256",
                    "--q-lora-rank", "64", "--moe-aux-loss-coeff", "0.01"],
}


@pytest.mark.parametrize("family", list(TODAY))
def test_todays_families_bf16_track_fp32(tmp_path, family):
    """Each family trains on the GPU in bf16 as in fp32 (MLA through SDPA with values narrower than the keys), and
    Qwen3 under --compile as eager."""
    ref, _ = run_engine(tmp_path / "fp32", 1, *GPU, *TODAY[family])
    lines, _ = run_engine(tmp_path / "bf16", 1, *GPU, *TODAY[family], "--bf16")
    close(train_losses(lines), train_losses(ref), rel=2e-2)
    assert train_losses(lines)[-1] < train_losses(lines)[0] - 0.3
    if family == "qwen3":
        compiled, _ = run_engine(tmp_path / "compiled", 1, *GPU, *TODAY[family], "--bf16", "--compile")
        close(train_losses(compiled), train_losses(lines), rel=1e-2)


FAST = ["--compile", "--compile-mode", "reduce-overhead", "--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl",
        "triton", "--gradient-accumulation-fusion", "--optimizer-step-fusion"]


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_fast_configuration_tracks_plain_over_50_steps_on_real_data(tmp_path, family):
    """The benchmark's fastest flags (bench_pretrain.py's engine+best) against the plain bf16 engine: run_gpt.sh on
    the demo corpus, 50 iterations each way; every loss within 1e-2 relative (bf16 rounding differs between
    the fused and the unfused kernels; the printed figure goes to RESULTS.md)."""
    import json

    from test_run_gpt_script import _launch

    runs = {}
    for name, extra in (("plain", []), ("fast", FAST)):
        rc, err = _launch(tmp_path / name, "--train-iters", "50", "--eval-iters", "0", "--hidden-dropout", "0",
                          "--attention-dropout", "0", *extra, MODEL_FAMILY=family, LOG_INTERVAL="10",
                          DEMO_DIR=str(tmp_path / "demo"))
        assert rc == 0, err[-4000:]
        runs[name] = [x["loss"] for x in map(json.loads, open(tmp_path / name / "out" / "metrics.jsonl")) if "loss" in x]
    plain, fast = runs["plain"], runs["fast"]
    worst = max(abs(a - b) / abs(a) for a, b in zip(plain, fast))
    print(f"{family}: loss {plain[0]:.3f} -> {plain[-1]:.3f}, fast vs plain max relative difference {worst:.2e}")
    assert len(plain) == 50 and plain[-1] < plain[0] - 1.0
    assert fast == pytest.approx(plain, rel=1e-2)


def test_step_times_add_up_to_the_wall_clock_with_deferred_metrics(tmp_path):
    """Step metrics are read one step late on a GPU, and the host queues ahead until CUDA's launch queue is full,
    so it reads step N only near the end of step N+1. Each step's time comes from CUDA events (step_clock.py):
    the steps between two logged iterations (read at once) add up to the wall clock between them. Timed by the
    host, the window after each logged iteration would have counted one step too few (10% at this interval)."""
    lines, _ = run_engine(tmp_path, 1, "--bf16", "--hidden-size", "1024", "--num-attention-heads", "16",
                          "--num-layers", "8", "--seq-length", "1024", "--micro-batch-size", "8",
                          "--global-batch-size", "32", "--vocab-size", "32000", "--train-iters", "30",
                          "--log-interval", "10", "--eval-iters", "0")
    steps = {x["iteration"]: x for x in lines if "loss" in x}
    for a, b in ((10, 20), (20, 30)):
        summed = sum(steps[i]["step_time"] for i in range(a + 1, b + 1))
        wall = steps[b]["wall_time"] - steps[a]["wall_time"]
        assert summed == pytest.approx(wall, rel=0.04), f"iterations {a + 1}-{b}: step times {summed:.3f} s, wall {wall:.3f} s"


def test_varlen_kernel_equals_the_cpu_packed_path():
    """Packed attention: torch's variable-length flash kernel (bf16, the GPU path) against SDPA with the conversations'
    block-diagonal causal mask (the CPU path, here in fp32), grouped-query heads, outputs and gradients."""
    import torch

    from megatron_patch.models.sdpa_attention import packed_sdpa, varlen_causal_attention

    torch.manual_seed(0)
    cu = torch.tensor([0, 100, 357, 512, 1000, 1024], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(1024, h, 64, device="cuda") for h in (8, 2, 2))
    grad = torch.randn(1024, 8, 64, device="cuda")
    outs = []
    for fn, dtype in ((varlen_causal_attention, torch.bfloat16), (packed_sdpa, torch.float32)):
        xs = [x.to(dtype).requires_grad_() for x in (q, k, v)]
        args = (*xs, cu, 488, None) if fn is varlen_causal_attention else (*xs, cu, None)
        out = fn(*args)
        out.backward(grad.to(dtype))
        outs.append([out.float()] + [x.grad.float() for x in xs])
    for name, a, b in zip(("out", "dq", "dk", "dv"), *outs):
        err = ((a - b).abs().max() / b.abs().max()).item()
        assert err < 2e-2, f"{name}: relative difference {err:.2e}"


@pytest.mark.parametrize("extra", [[], ["--compile"]], ids=["eager", "compile"])
def test_packed_sft_on_the_gpu_tracks_padded(sft_data, tmp_path, extra):
    """bf16 packed SFT (the varlen kernel; compiled layers too) against padded samples (SDPA): the same conversations
    per global batch, every loss within bf16 noise."""
    from sft_utils import sft_flags

    runs = {}
    for name, flags in (("padded", ["--no-pack-sequences", "--micro-batch-size", "4", "--global-batch-size",
                                     str(sft_data.conversations)]),
                        ("packed", ["--micro-batch-size", "2", "--global-batch-size", str(sft_data.packed_samples),
                                    *extra])):
        lines, _ = run_engine(tmp_path / name, 1, *sft_flags(sft_data, "--bf16", "--train-iters", "10", *flags), base=[])
        runs[name] = train_losses(lines)
    close(runs["packed"], runs["padded"], rel=2e-2)
    assert runs["packed"][-1] < runs["packed"][0]


def test_lora_compiled_tracks_eager(tmp_path):
    """LoRA (bf16 base, adapters' fp32 main weights) under --compile trains like eager."""
    flags = [*GPU, "--bf16", "--lora-rank", "8", "--swiglu", "--position-embedding-type", "rope",
             "--normalization", "RMSNorm", "--disable-bias-linear"]
    eager, proc = run_engine(tmp_path / "eager", 1, *flags)
    compiled, _ = run_engine(tmp_path / "compiled", 1, *flags, "--compile")
    assert "LoRA rank 8" in proc.stdout
    close(train_losses(compiled), train_losses(eager), rel=1e-2)
    assert train_losses(eager)[-1] < train_losses(eager)[0]


@pytest.mark.parametrize("recipe", [["--fp8-format", "hybrid"], ["--fp8-format", "e4m3", "--fp8-recipe", "rowwise"]],
                         ids=["tensorwise", "rowwise"])
def test_fp8_on_the_gpu_tracks_bf16(tmp_path, bf16, recipe):
    """torch._scaled_mm (no emulation) in every linear of the layers (--fp8-layers all: the test model is small),
    compiled, with fused weight-gradient accumulation: FP8 learns like bf16, and its GEMMs really are float8 (the
    losses are not bf16's to the last digit)."""
    lines, proc = run_engine(tmp_path, 1, *GPU, "--bf16", *recipe, "--fp8-layers", "all", "--compile",
                             "--gradient-accumulation-fusion")
    assert "torch._scaled_mm" in proc.stdout
    ref = train_losses(bf16[0])
    close(train_losses(lines), ref, rel=2e-2)
    assert train_losses(lines) != pytest.approx(ref, rel=1e-4)


def test_moe_grouped_steps_without_host_synchronisation(tmp_path):
    """--moe-grouped-gemm at EP 1 (the device dispatcher, models/moe_dispatch.py), the whole MoE layer compiled: no
    training step after the first two makes the host wait for the GPU (torch.cuda.set_sync_debug_mode("error"))."""
    import json
    import subprocess
    import sys

    from engine_utils import ROOT, TINY

    out = tmp_path / "sync.json"
    argv = [*TINY, "--train-iters", "6", "--eval-iters", "0", "--bf16", "--model-family", "llama", "--num-experts", "8",
            "--moe-router-topk", "2", "--moe-ffn-hidden-size", "128", "--moe-aux-loss-coeff", "0.01",
            "--moe-grouped-gemm", "--compile", "--log-interval", "100"]
    proc = subprocess.run([sys.executable, f"{ROOT}/tests/sync_free_worker.py", str(out), *argv], capture_output=True,
                          text=True, cwd=tmp_path, timeout=600)
    result = json.loads(out.read_text())
    assert result["sync"] is None, "\n\n".join(result["sites"])
    assert result["checked_steps"] == 4, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert "MoE dispatch on the device: 4 MoE layers" in proc.stdout
