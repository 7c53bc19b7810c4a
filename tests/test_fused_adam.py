"""--optimizer-step-fusion (training/fused_adam.py, compat/optimizer.py:fuse_optimizer_step): the Adam step in one
Triton kernel per tensor, reading the gradient buffer and applying clipping. The kernel against torch's Adam/AdamW
(Triton's interpreter on the CPU; torch's fused CUDA AdamW on a GPU), the engine against the unfused engine
(clipping active), checkpoints saved by one resumed by the other, and the flag's refusals."""
from __future__ import annotations

import re
import shutil

import pytest
import torch

from engine_utils import per_iteration, run_engine, run_engines_in_one_process
from megatron_patch.config import ConfigError, parse_args
from megatron_patch.training.fused_adam import BLOCK, bias_corrections, step_adam

BF16 = ["--bf16", "--clip-grad", "0.05", "--adam-eps", "1e-4"]  # grad norm ~1.5: every step clips; with an eps
# near the clipped gradients (~1e-4 an element) Adam's update depends on their scale, so a lost clip shows.
# The same update as torch's up to fp32 rounding order, but now and then a bf16 weight then rounds the other way:
# losses agree to ~2e-5 (measured), grad norms to the 4th digit.
LOSS_REL = 1e-4


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


UNALIGNED = ((3,), (BLOCK + 5, 2), (7, 5))  # sizes not multiples of 16: the kernel's plain masked path
ALIGNED = ((48,), (BLOCK + 16, 2), (32, 5))  # multiples of 16 at 16-byte aligned addresses: the hinted path


def _params(device, shapes):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(*s, generator=g) * 0.1).to(device) for s in shapes]


def _reference_and_fused(opt_cls, grad_dtype, device, steps=3, ref_impl=None, shapes=UNALIGNED):
    """Run `steps` steps of torch's `opt_cls` on fp32 copies (gradient = buffer value x clip factor, as megatron-core
    clips) and of step_adam on the same values; returns both optimizers and the bf16 model tensors."""
    weights = _params(device, shapes)
    ref = [w.clone().requires_grad_() for w in weights]
    main = [w.clone() for w in weights]
    model = [w.to(torch.bfloat16) for w in weights]
    groups = lambda ps: [dict(params=ps[:2], weight_decay=0.1), dict(params=ps[2:], weight_decay=0.0)]  # noqa: E731
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    ref_opt = opt_cls(groups(ref), **(ref_impl or dict(foreach=False)), **kw)
    fused_opt = opt_cls(groups(main), **kw)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        coef = torch.tensor([0.5 + 0.2 * step], device=device)
        for group_ref, group_fused in zip(ref_opt.param_groups, fused_opt.param_groups):
            group_ref["lr"] = group_fused["lr"] = 1e-2 / (step + 1)  # the scheduler changes lr between steps
        for r, m in zip(ref, main):
            grad = torch.randn(r.shape, generator=g).to(device, grad_dtype)
            r.grad = grad.float() * coef
            m.grad_dtype = None
            m.grad = grad
        ref_opt.step()
        step_adam(fused_opt, {id(m): t for m, t in zip(main, model)}, coef)
    return ref_opt, fused_opt, ref, main, model


@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, torch.optim.Adam], ids=["adamw", "adam-l2"])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32], ids=["bf16-grads", "fp32-grads"])
@pytest.mark.parametrize("shapes", [UNALIGNED, ALIGNED], ids=["unaligned", "aligned"])
def test_kernel_matches_torch_adam(opt_cls, grad_dtype, shapes):
    ref_opt, fused_opt, ref, main, model = _reference_and_fused(opt_cls, grad_dtype, "cpu", shapes=shapes)
    table = fused_opt._fused_adam_tables[(0, (grad_dtype, torch.bfloat16))]
    assert table.aligned == (shapes is ALIGNED) and table.blocks == sum(-(-m.numel() // BLOCK) for m in main[:2])
    for r, m, t in zip(ref, main, model):
        torch.testing.assert_close(m, r.detach(), rtol=1e-5, atol=1e-7)
        rs, ms = ref_opt.state[r], fused_opt.state[m]
        torch.testing.assert_close(ms["exp_avg"], rs["exp_avg"], rtol=1e-5, atol=1e-6)  # gradients ~1
        torch.testing.assert_close(ms["exp_avg_sq"], rs["exp_avg_sq"], rtol=1e-5, atol=1e-7)
        assert float(ms["step"]) == float(rs["step"]) == 3.0
        # the bf16 model weight is the fp32 main weight rounded to nearest even, as torch's copy_ rounds it
        assert torch.equal(t, m.to(torch.bfloat16))


def test_bf16_moments_are_torchs_update_with_moments_rounded_each_step():
    """--exp-avg-dtype/--exp-avg-sq-dtype bf16: the moments are computed in fp32 from the stored bf16 ones, the update
    uses those fp32 values, and they are stored rounded to nearest even; the weights stay fp32."""
    weights = _params("cpu", ALIGNED)
    main = [w.clone() for w in weights]
    model = [w.to(torch.bfloat16) for w in weights]
    opt = torch.optim.AdamW([dict(params=main, weight_decay=0.1)], lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    ref_p = [w.clone() for w in weights]
    ref_m = [torch.zeros_like(w, dtype=torch.bfloat16) for w in weights]
    ref_v = [torch.zeros_like(w, dtype=torch.bfloat16) for w in weights]
    g = torch.Generator().manual_seed(1)
    for step in range(1, 4):
        for i, m in enumerate(main):
            grad = torch.randn(m.shape, generator=g).to(torch.bfloat16)
            m.grad_dtype = None
            m.grad = grad
            gf = grad.float()
            p = ref_p[i] * (1 - 1e-2 * 0.1)
            mf = 0.9 * ref_m[i].float() + 0.1 * gf
            vf = 0.95 * ref_v[i].float() + 0.05 * gf * gf
            denom = vf.sqrt() / (1 - 0.95 ** step) ** 0.5 + 1e-8
            ref_p[i] = p - (1e-2 / (1 - 0.9 ** step)) * mf / denom
            ref_m[i], ref_v[i] = mf.to(torch.bfloat16), vf.to(torch.bfloat16)
        step_adam(opt, {id(m): t for m, t in zip(main, model)}, None, moments=(torch.bfloat16, torch.bfloat16))
    for i, m in enumerate(main):
        st = opt.state[m]
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.bfloat16 and m.dtype == torch.float32
        torch.testing.assert_close(m, ref_p[i], rtol=1e-5, atol=1e-6)
        # the same fp32 value rounded: equal, but where fp32 operation order lands on the other side of a tie
        for got, want in ((st["exp_avg"], ref_m[i]), (st["exp_avg_sq"], ref_v[i])):
            assert (got != want).float().mean() < 1e-3
            torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-8)


def test_launch_table_is_reused_and_follows_tensors_that_move():
    """The launch table (the tensors' addresses) is built once and reused; when a state tensor is replaced (a
    checkpoint load does that), the next step writes the new tensor, not the old memory."""
    ref_opt, fused_opt, ref, main, model = _reference_and_fused(torch.optim.AdamW, torch.bfloat16, "cpu", steps=2)
    tables = dict(fused_opt._fused_adam_tables)
    models = {id(m): t for m, t in zip(main, model)}
    for r, m in zip(ref, main):
        fused_opt.state[m]["exp_avg"] = fused_opt.state[m]["exp_avg"].clone()  # same values, new memory
        r.grad = torch.full_like(r, 0.375)  # exact in bf16
        m.grad = torch.full_like(m, 0.375, dtype=torch.bfloat16)
    ref_opt.step()
    step_adam(fused_opt, models, None)
    assert all(fused_opt._fused_adam_tables[k] is not t for k, t in tables.items())  # rebuilt
    for r, m in zip(ref, main):
        torch.testing.assert_close(fused_opt.state[m]["exp_avg"], ref_opt.state[r]["exp_avg"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(m, r.detach(), rtol=1e-5, atol=1e-7)
    again = dict(fused_opt._fused_adam_tables)
    step_adam(fused_opt, models, None)
    assert all(fused_opt._fused_adam_tables[k] is t for k, t in again.items())  # nothing moved: reused


def test_bias_corrections_in_float64():
    c = bias_corrections(torch.tensor(3.0), 0.9, 0.999)
    assert c.dtype == torch.float64
    assert c.tolist() == pytest.approx([1 - 0.9 ** 3, 1 - 0.999 ** 3], rel=1e-12)


@pytest.mark.parametrize("extra", [["--grad-reduce-in-bf16"], pytest.param([], marks=pytest.mark.slow)],  # CI time
                         ids=["bf16-grads", "fp32-grads"])
def test_engine_with_fusion_trains_like_the_unfused_engine(tmp_path, extra):
    args = ["--train-iters", "5", "--eval-iters", "0", *BF16, *extra]
    runs, proc = run_engines_in_one_process(tmp_path, {"plain": args, "fused": [*args, "--optimizer-step-fusion"]})
    plain, fused = runs["plain"], runs["fused"]
    assert proc.stdout.count("optimizer step fusion: Adam in one Triton kernel launch per param group") == 1
    assert per_iteration(fused, "loss") == pytest.approx(per_iteration(plain, "loss"), rel=LOSS_REL)
    assert per_iteration(fused, "grad_norm") == pytest.approx(per_iteration(plain, "grad_norm"), rel=1e-3)


def test_engine_with_bf16_moments_tracks_fp32_moments_with_a_third_less_optimizer_state(tmp_path):
    args = ["--train-iters", "5", "--eval-iters", "0", *BF16, "--grad-reduce-in-bf16", "--optimizer-step-fusion"]
    runs, proc = run_engines_in_one_process(tmp_path, {
        "fp32": args, "bf16": [*args, "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]})
    assert "moments in bf16/bf16 (4 bytes per parameter instead of 8)" in proc.stdout
    fp32, bf16 = runs["fp32"], runs["bf16"]
    # fp32 main weights (4 bytes) + moments (8, or 4 in bf16) per parameter
    assert bf16[0]["bytes_optimizer"] * 12 == pytest.approx(fp32[0]["bytes_optimizer"] * 8, rel=1e-3)
    assert per_iteration(bf16, "loss") == pytest.approx(per_iteration(fp32, "loss"), rel=2e-3)
    assert per_iteration(bf16, "loss") != pytest.approx(per_iteration(fp32, "loss"), rel=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "2"], ["--model-family", "llama",
                                    "--num-experts", "2", "--moe-router-topk", "2"]], ids=["tp2", "moe"])
def test_engine_with_fusion_in_other_layouts(tmp_path, layout):
    # TP2: the norm over both ranks' shards (duplicated norms counted once); MoE: dense and expert wrappers
    args = ["--train-iters", "4", "--eval-iters", "0", *BF16, "--grad-reduce-in-bf16", *layout]
    nproc = 2 if "--tensor-model-parallel-size" in layout else 1
    plain, _ = run_engine(tmp_path / "plain", nproc, *args)
    fused, _ = run_engine(tmp_path / "fused", nproc, *args, "--optimizer-step-fusion")
    assert per_iteration(fused, "loss") == pytest.approx(per_iteration(plain, "loss"), rel=LOSS_REL)
    assert per_iteration(fused, "grad_norm") == pytest.approx(per_iteration(plain, "grad_norm"), rel=1e-3)


@pytest.mark.slow
def test_checkpoints_are_interchangeable_with_the_unfused_optimizer(tmp_path):
    args = ["--train-iters", "6", "--eval-iters", "0", *BF16, "--grad-reduce-in-bf16"]
    straight, _ = run_engine(tmp_path / "a", 1, *args, "--save", str(tmp_path / "a" / "ck"), "--save-interval", "3")
    ck = tmp_path / "b" / "ck"
    shutil.copytree(tmp_path / "a" / "ck", ck)
    shutil.rmtree(ck / "iter_0000006")
    (ck / "latest_checkpointed_iteration.txt").write_text("3")
    # saved unfused at iteration 3, resumed fused: the moments and step count carry over
    resumed, proc = run_engine(tmp_path / "b", 1, *args, "--load", str(ck), "--optimizer-step-fusion")
    assert "(iteration 3)" in proc.stdout
    want = per_iteration(straight, "loss")[3:]
    assert per_iteration(resumed, "loss") == pytest.approx(want, rel=LOSS_REL)


@pytest.mark.parametrize("argv,match", [
    (["--optimizer-step-fusion"], "add --bf16"),
    (["--optimizer-step-fusion", "--bf16", "--zero-1-memory-optimization"], "--zero-1-memory-optimization steps"),
    (["--optimizer-step-fusion", "--bf16", "--optimizers", "apex_lamb"], "--optimizers apex_lamb steps"),
    (["--bf16", "--exp-avg-dtype", "bf16"], "--exp-avg-dtype bf16 keeps Adam's moments in bf16 through the fused Adam "
                                             "kernel: add --optimizer-step-fusion"),
])
def test_flag_rejections(argv, match):
    with pytest.raises(ConfigError, match=re.escape(match)):
        parse_args(["--mock-data"] + argv).validate(1)


def test_refused_without_gpu_or_interpreter(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="set TRITON_INTERPRET=1"):
        parse_args(["--mock-data", "--bf16", "--optimizer-step-fusion"]).validate(1)


@pytest.mark.parametrize("grad", ["bf16", "fp32"])
def test_kernel_compiles_for_the_gpu(grad, monkeypatch, tmp_path):
    """The kernel as the GPU runs it (triton.jit, not the interpreter) compiles for an H100 (sm_90) down to PTX with
    16-byte loads and stores when the launcher found every pointer and size aligned (a memory-bound kernel: vector
    width is its speed; its pointers come from a table, so only the ALIGNED hints tell the compiler), and
    without them when it did not."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from megatron_patch.training import fused_adam

    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    ptx = {}
    for aligned in (True, False):
        signature = {"table_ptr": "*i64", "block_tensor_ptr": "*i32", "corr_ptr": "*fp64", "coef_ptr": "*fp32",
                     "lr": "fp32", "beta1": "fp32", "beta2": "fp32", "eps": "fp32", "weight_decay": "fp32"}
        # bf16 gradients with bf16 moments (--exp-avg-dtype bf16), fp32 gradients with fp32 moments
        moment = tl.bfloat16 if grad == "bf16" else tl.float32
        constexprs = {"GRAD": getattr(tl, {"bf16": "bfloat16", "fp32": "float32"}[grad]), "MODEL": tl.bfloat16,
                      "MOMENT": moment, "MOMENT_SQ": moment, "ALIGNED": aligned, "DECOUPLED": True, "BLOCK": BLOCK}
        signature.update({k: "constexpr" for k in constexprs})
        src = ASTSource(triton.jit(fused_adam._adam_kernel), signature=signature, constexprs=constexprs)
        ptx[aligned] = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
    assert "ld.global.v4.b32" in ptx[True] and "st.global.v4.b32" in ptx[True]
    assert "ld.global.v4.b32" not in ptx[False]


@pytest.mark.gpu
def test_kernel_on_cuda_matches_torch_fused_adamw(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ref_opt, fused_opt, ref, main, model = _reference_and_fused(torch.optim.AdamW, torch.bfloat16, "cuda",
                                                                ref_impl=dict(fused=True))
    for r, m, t in zip(ref, main, model):
        torch.testing.assert_close(m, r.detach(), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(fused_opt.state[m]["exp_avg_sq"], ref_opt.state[r]["exp_avg_sq"], rtol=1e-5,
                                   atol=1e-12)
        assert torch.equal(t, m.to(torch.bfloat16))
    # after the first step (state, constants) a step makes the host wait for nothing
    coef = torch.full((1,), 0.5, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        step_adam(fused_opt, {id(m): t for m, t in zip(main, model)}, coef)
    finally:
        torch.cuda.set_sync_debug_mode("default")
