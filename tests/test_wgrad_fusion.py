"""--gradient-accumulation-fusion (models/wgrad_fusion.py): linear layers accumulate their weight gradients straight
into megatron-core's gradient buffer. The accumulation op against the plain product, the autograd function's
gradients against torch's linear, one graph under torch.compile, and the engine against the unfused engine."""
from __future__ import annotations

import pytest
import torch

from engine_utils import run_engine, train_losses
from megatron_patch.models.wgrad_fusion import _LinearIntoMainGrad, accumulate_wgrad


def _data(dtype, seed=0, tokens=24, n_in=16, n_out=8):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, tokens // 2, n_in, generator=g).to(dtype)
    w = (torch.randn(n_out, n_in, generator=g) * 0.2).to(dtype)
    b = torch.randn(n_out, generator=g).to(dtype)
    return x, w, b


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_accumulate_wgrad_adds_the_weight_gradient_in_place(grad_dtype):
    g = torch.Generator().manual_seed(1)
    dy, x = torch.randn(24, 8, generator=g), torch.randn(24, 16, generator=g)
    start = torch.randn(8, 16, generator=g).to(grad_dtype)
    main_grad = start.clone()
    ptr = main_grad.data_ptr()
    accumulate_wgrad(main_grad, dy.to(grad_dtype), x.to(grad_dtype))
    want = start.double() + dy.double().t() @ x.double()
    assert main_grad.data_ptr() == ptr
    tol = dict(rtol=2e-2, atol=0.1) if grad_dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(main_grad.double(), want, **tol)


def _fused_and_plain(dtype, compiled=False):
    """Two micro batches through the fused linear and through torch's; with `compiled`, also the code inductor
    generated."""
    from torch._inductor.utils import run_and_get_code

    x, w, b = _data(dtype)
    # The buffer is one flat tensor holding both gradients (as megatron-core's): the views share a version counter.
    flat = torch.zeros(w.numel() + 5, dtype=torch.float32)
    main_grad = flat[5:].view_as(w)
    xf, wf, bf = (t.clone().requires_grad_() for t in (x, w, b))
    xp, wp, bp = (t.clone().requires_grad_() for t in (x, w, b))

    def fused(x_, w_, b_):
        return _LinearIntoMainGrad.apply(x_, w_, b_, main_grad)

    fn = torch.compile(fused, fullgraph=True) if compiled else fused

    def steps():
        for _ in range(2):  # two micro batches accumulate
            (fn(xf, wf, bf).float() ** 2).sum().backward()
            (torch.nn.functional.linear(xp, wp, bp).float() ** 2).sum().backward()

    if not compiled:
        steps()
        return (xf, wf, bf, main_grad, flat), (xp, wp, bp), []
    codes = run_and_get_code(steps)[1]
    return (xf, wf, bf, main_grad, flat), (xp, wp, bp), codes


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)],  # slow: inductor's C++ build
                         ids=["eager", "compiled"])
def test_linear_into_main_grad_gives_torchs_gradients(compiled):
    """Compiled, the function is one graph (fullgraph) whose backward calls the op on the buffer itself: a
    functionalised copy back would cost the read-modify-write the fusion exists to save."""
    (xf, wf, bf, main_grad, flat), (xp, wp, bp), codes = _fused_and_plain(torch.float32, compiled)
    torch.testing.assert_close(main_grad, wp.grad, rtol=1e-5, atol=1e-5)
    assert wf.grad is None  # nothing left for megatron-core's hook to add a second time
    assert torch.count_nonzero(flat[:5]) == 0  # the rest of the buffer is untouched
    torch.testing.assert_close(xf.grad, xp.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bf.grad, bp.grad, rtol=1e-5, atol=1e-6)
    if compiled:
        backward = [c for c in codes if "accumulate_wgrad" in c]
        assert backward, "the compiled backward does not call accumulate_wgrad"
        assert "copy_" not in backward[0].split("accumulate_wgrad")[1].split("return")[0]


@pytest.mark.slow
@pytest.mark.parametrize("nproc,layout,extra,fused", [
    (1, [], [], 17), (1, [], ["--bf16", "--grad-reduce-in-bf16", "--model-family", "llama"], 17),
    (1, [], ["--compile"], 17),  # 4 layers x 4 + output
    # TP 2: row-parallel linears fused (4 layers x 2), column-parallel ones (an all-reduce inside) on megatron-core's
    (2, ["--tensor-model-parallel-size", "2"], [], 8), (2, ["--zero-1-memory-optimization"], [], 17),
], ids=["fp32", "bf16-grads-llama", "compile", "tp2", "dp2-zero1"])
def test_engine_with_fusion_trains_like_the_unfused_single_process_run(tmp_path, nproc, layout, extra, fused):
    args = ["--train-iters", "4", "--eval-iters", "0", *extra]
    plain, _ = run_engine(tmp_path / "plain", 1, *args)
    lines, proc = run_engine(tmp_path / "fused", nproc, *args, *layout, "--gradient-accumulation-fusion")
    assert f"gradient accumulation fusion: {fused} linear layers accumulate" in proc.stdout
    assert train_losses(lines) == pytest.approx(train_losses(plain), rel=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_accumulate_wgrad_on_cuda_matches_the_fp32_product(grad_dtype):
    """On CUDA a bf16 GEMM accumulates into the fp32 buffer directly (aten::addmm.dtype_out)."""
    g = torch.Generator().manual_seed(2)
    dy, x = torch.randn(512, 256, generator=g), torch.randn(512, 128, generator=g)
    start = torch.randn(256, 128, generator=g)
    main_grad = start.to("cuda", grad_dtype)
    accumulate_wgrad(main_grad, dy.to("cuda", torch.bfloat16), x.to("cuda", torch.bfloat16))
    want = start.double() + dy.bfloat16().double().t() @ x.bfloat16().double()
    tol = dict(rtol=1e-5, atol=1e-3) if grad_dtype == torch.float32 else dict(rtol=1e-2, atol=0.25)
    torch.testing.assert_close(main_grad.double().cpu(), want, **tol)
