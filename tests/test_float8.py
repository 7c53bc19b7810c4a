"""FP8 through torchao (models/float8.py; `--fp8-format`, `--fp8-recipe`): our float8 linear against torchao's own
Float8Linear (emulated: fp32 GEMMs of the float8-rounded operands), the size rule, the flags' refusals, and the
engine: tensor parallelism with sequence parallelism, gradient-accumulation fusion and ZeRO-1 against the
single-process FP8 run (tensorwise: the amax reduced over TP makes them the same computation), and checkpoints that
load with FP8 off."""
from __future__ import annotations

import re

import pytest
import torch

from engine_utils import run_engine, run_engines_in_one_process, train_losses
from megatron_patch.config import ConfigError
from megatron_patch.models.float8 import Float8Linear, keeps_fp8

FP8 = ["--fp8-format", "hybrid", "--fp8-layers", "all"]
SHORT = ["--train-iters", "4", "--eval-iters", "0", "--lr", "1e-3"]


def _linear_pair(recipe: str, seed: int = 0):
    from torchao.float8.config import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear as TorchaoFloat8Linear

    g = torch.Generator().manual_seed(seed)
    plain = torch.nn.Linear(64, 32, bias=False)
    with torch.no_grad():
        plain.weight.copy_(torch.randn(32, 64, generator=g) * 0.1)
    config = Float8LinearConfig.from_recipe_name(recipe)
    import dataclasses
    ref = TorchaoFloat8Linear.from_float(torch.nn.Linear(64, 32, bias=False), dataclasses.replace(config, emulate=True))
    ref.weight = torch.nn.Parameter(plain.weight.detach().clone())
    x = torch.randn(3, 16, 64, generator=g)
    return plain, ref, x


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_our_float8_linear_is_torchaos(recipe):
    """Output and both gradients equal torchao's Float8Linear (one process); they differ from the fp32 linear by the
    float8 rounding only."""
    plain, ref, x = _linear_pair(recipe)
    ours = Float8Linear(recipe, row_parallel=False, emulate=True, main_grad_fusion=False)
    w = plain.weight.detach().clone().requires_grad_()
    xa, xb, xc = (x.clone().requires_grad_() for _ in range(3))
    dy = torch.randn(3, 16, 32, generator=torch.Generator().manual_seed(5))
    y = ours.matmul(xa, w)
    y_ref = ref(xb)
    y_fp32 = plain(xc)
    (y * dy).sum().backward()
    (y_ref * dy).sum().backward()
    (y_fp32 * dy).sum().backward()
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=0, atol=0)
    torch.testing.assert_close(w.grad, ref.weight.grad, rtol=0, atol=0)
    for mine, exact in ((y, y_fp32), (xa.grad, xc.grad), (w.grad, plain.weight.grad)):
        err = ((mine - exact).norm() / exact.norm()).item()
        assert 1e-4 < err < 0.1, err  # rounded to float8 (e4m3: 3 mantissa bits), and only that


def _sharded_worker(rank: int, port: int, out: str) -> None:
    """Rank `rank` of 2 (gloo): the column- and row-parallel shards of one linear through Float8Linear, tensorwise,
    with the gradients of the full tensors gathered; rank 0 saves them beside the one-process result."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(24, 64, generator=g), torch.randn(32, 64, generator=g) * 0.1
    w[3, 7] = 2.0  # one outlier: a rank's own amax would differ from the whole tensor's
    dy = torch.randn(24, 32, generator=g)
    dy[5, 30] = 40.0
    whole = {}
    full = Float8Linear("tensorwise", row_parallel=False, emulate=True, main_grad_fusion=False)
    xf, wf = x.clone().requires_grad_(), w.clone().requires_grad_()
    yf = full.matmul(xf, wf)
    yf.backward(dy)
    whole = {"y": yf.detach(), "dx": xf.grad, "dw": wf.grad}
    group, got = dist.group.WORLD, {}
    # column-parallel: W cut along out; x whole; dX partial sums all-reduced (megatron-core's copy-to-TP region)
    col = Float8Linear("tensorwise", row_parallel=False, emulate=True, main_grad_fusion=False, tp_group=group)
    xc, wc = x.clone().requires_grad_(), w[16 * rank:16 * (rank + 1)].clone().requires_grad_()
    yc = col.matmul(xc, wc)
    yc.backward(dy[:, 16 * rank:16 * (rank + 1)])
    dist.all_reduce(xc.grad)
    got["col"] = {"y": _gather(yc.detach(), 1), "dx": xc.grad, "dw": _gather(wc.grad, 0)}
    # row-parallel: W and x cut along in; the partial outputs summed (the row-parallel all-reduce)
    row = Float8Linear("tensorwise", row_parallel=True, emulate=True, main_grad_fusion=False, tp_group=group)
    xr, wr = x[:, 32 * rank:32 * (rank + 1)].clone().requires_grad_(), w[:, 32 * rank:32 * (rank + 1)].clone().requires_grad_()
    yr = row.matmul(xr, wr)
    yr.backward(dy)
    y = yr.detach().clone()
    dist.all_reduce(y)
    got["row"] = {"y": y, "dx": _gather(xr.grad, 1), "dw": _gather(wr.grad, 1)}
    if rank == 0:
        torch.save({"whole": whole, **got}, out)
    dist.destroy_process_group()


def _gather(t: torch.Tensor, dim: int) -> torch.Tensor:
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(2)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim)


def test_tensorwise_shards_quantise_as_the_whole_tensor(tmp_path):
    """Two processes, each with a column- (or row-) parallel shard: the output, the input gradient and the weight
    gradient assembled from the shards equal the one-process float8 linear's (fp32 sums in another order aside):
    the weight, the row-parallel input and the column-parallel output gradient are scaled by their whole tensor's
    amax, reduced over the group."""
    import torch.multiprocessing as mp

    from engine_utils import free_port

    out = str(tmp_path / "shards.pt")
    mp.start_processes(_sharded_worker, args=(free_port(), out), nprocs=2, start_method="spawn")
    res = torch.load(out)
    for layout in ("col", "row"):
        for key in ("y", "dx", "dw"):
            torch.testing.assert_close(res[layout][key], res["whole"][key], rtol=1e-5, atol=1e-5,
                                       msg=lambda m, layout=layout, key=key: f"{layout} {key}: {m}")


def test_the_size_rule():
    """torchao's measured rule (module docstring), dims multiples of 16 first."""
    assert keeps_fp8("tensorwise", 6144, 2048, 3072, 2048)
    assert not keeps_fp8("tensorwise", 1024, 4096, 1024, 4096)  # small output and in <= 4096: slower in FP8
    assert keeps_fp8("tensorwise", 1024, 8192, 1024, 8192)
    assert not keeps_fp8("tensorwise", 6144, 2048, 3072, 2040)  # a shard not a multiple of 16
    assert not keeps_fp8("rowwise", 2048, 8192, 2048, 8192) and keeps_fp8("rowwise", 4096, 4096, 4096, 4096)
    assert not keeps_fp8("rowwise", 4096, 2048, 4096, 2048) and keeps_fp8("rowwise", 8192, 2048, 8192, 2048)
    assert keeps_fp8("tensorwise", 64, 64, 32, 64, layers="all") and not keeps_fp8("tensorwise", 64, 8, 64, 8, "all")


@pytest.mark.parametrize("argv,match", [
    (["--fp8-format", "e4m3"], "torchao's tensorwise recipe is --fp8-format hybrid"),
    (["--fp8-format", "hybrid", "--fp8-recipe", "rowwise"], "pass --fp8-format e4m3, or --fp8-recipe tensorwise"),
    (["--fp8-format", "hybrid", "--fp8-recipe", "delayed"], "--fp8-recipe delayed needs Transformer Engine"),
    (["--fp8-recipe", "rowwise"], "add --fp8-format (hybrid or e4m3) to turn it on"),
    (["--fp8-format", "hybrid", "--fp16"], "use --bf16"),
    (["--fp8-format", "hybrid", "--lora-rank", "8"], "--fp8-format with --lora-rank is not supported"),
])
def test_fp8_flag_rejections(argv, match):
    from test_config import cfg

    with pytest.raises(ConfigError, match=re.escape(match)):
        cfg(*argv).validate(1)


def test_engine_fp8_tensor_parallel_equals_one_process_and_checkpoints_load_without_fp8(tmp_path):
    """tensorwise at TP 2 with sequence parallelism, fused weight-gradient accumulation and ZeRO-1 gives the
    one-process FP8 run's losses and gradient norms (the amax reductions make the quantisation that of the whole
    tensors); FP8 is in effect (the losses differ from the fp32 run's); a checkpoint of the FP8 run resumes with FP8
    off (weights and optimizer state are fp32 either way)."""
    ckpt = str(tmp_path / "ckpt")
    runs, _ = run_engines_in_one_process(tmp_path, {
        "fp8": [*SHORT, *FP8],
        "fp32": SHORT,
        "fp8_half": [*SHORT, *FP8, "--exit-interval", "2", "--save", ckpt],
        "off": [*SHORT, "--load", ckpt, "--save", ckpt],
    })
    tp, proc = run_engine(tmp_path / "tp2", 2, *SHORT, *FP8, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                          "--gradient-accumulation-fusion", "--zero-1-memory-optimization", torchrun=False)
    assert "FP8: 16 linear layers run their GEMMs in float8 (torchao tensorwise recipe" in proc.stdout
    assert "16 FP8 linears accumulate their float8 GEMM's weight gradient into the buffer" in proc.stdout
    ref = runs["fp8"]
    # The first iteration (the same weights): forward and backward quantised alike. Later ones drift by FP8's
    # discontinuity: an fp32 rounding difference of the TP sums flips an element to the next float8 value.
    # (test_tensorwise_shards_quantise_as_the_whole_tensor checks one linear's gradients exactly.)
    assert train_losses(tp)[0] == pytest.approx(train_losses(ref)[0], rel=2e-7)
    assert tp[0]["grad_norm"] == pytest.approx(ref[0]["grad_norm"], rel=1e-4)
    assert train_losses(tp) == pytest.approx(train_losses(ref), rel=1e-3)
    diff = max(abs(a - b) for a, b in zip(train_losses(ref), train_losses(runs["fp32"])))
    assert 1e-5 < diff < 1e-2, diff
    after = train_losses(runs["off"])  # iterations 3 and 4 without FP8, from the FP8 run's iteration 2
    assert len(after) == 2 and after == pytest.approx(train_losses(ref)[2:], rel=2e-3)
    assert after != pytest.approx(train_losses(ref)[2:], rel=1e-6)


@pytest.mark.slow
def test_engine_fp8_rowwise_tensor_parallel_within_fp8_tolerance(tmp_path):
    """rowwise at TP 2: a shard's rows keep their own scales (not reduced), so TP 2 is close to TP 1, not equal."""
    args = [*SHORT, "--fp8-format", "e4m3", "--fp8-recipe", "rowwise", "--fp8-layers", "all"]
    one, _ = run_engine(tmp_path / "one", 1, *args)
    two, _ = run_engine(tmp_path / "two", 2, *args, "--tensor-model-parallel-size", "2", torchrun=False)
    assert train_losses(two) == pytest.approx(train_losses(one), rel=2e-3)


@pytest.mark.slow
def test_engine_fp8_compiles_without_graph_breaks(tmp_path):
    """--compile with FP8 (bf16, emulated): each layer one graph (the float8 output gradient stays inside it) and the
    eager FP8 run's losses."""
    import os

    args = [*SHORT, *FP8, "--bf16", "--num-layers", "2", "--train-iters", "3"]
    eager, _ = run_engine(tmp_path / "eager", 1, *args)
    os.environ["TORCH_LOGS"] = "graph_breaks"
    try:
        compiled, proc = run_engine(tmp_path / "compiled", 1, *args, "--compile")
    finally:
        del os.environ["TORCH_LOGS"]
    assert "Graph break" not in proc.stderr
    assert train_losses(compiled) == pytest.approx(train_losses(eager), rel=5e-3)
