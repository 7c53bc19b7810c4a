"""The Triton cross entropy (`--cross-entropy-loss-fusion --cross-entropy-fusion-impl triton`) gives megatron-core's
loss and logits' gradient (GPTModelWithVocab's unfused path: mask_vocab_padding + tensor_parallel.vocab_parallel_
cross_entropy) in fp32, bf16 and fp16, for block sizes that do and do not divide the vocabulary slice; at TP2 (with a
rank whose slice is all padding) against TP1 and against megatron-core at TP2; inside the GPT model at TP2; and in the
engine, where a run with the switch trains like one without it. The kernels as the GPU runs them are compiled for
sm_90 here (no GPU needed to compile); a `gpu` test runs them where there is one.

Without a GPU the kernels run in Triton's interpreter: every test sets TRITON_INTERPRET=1 for itself (monkeypatch;
the spawned TP processes and the engine's torchrun inherit it). The module decorates its kernels on first use and
calls no Triton library function that `import triton` decorated (see its docstring), so the variable needs no
setting before triton is imported (megatron-core imports it), and it does not leak into other test modules.
"""
from __future__ import annotations

import os
import re
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_utils import free_port  # noqa: E402
from loss_fusion_utils import TP2_BASE, engine_pair, model_check, rel, tp2_results_of  # noqa: E402

from megatron_patch.config import ConfigError, parse_args  # noqa: E402
from megatron_patch.models.triton_cross_entropy import _launch_config, triton_vocab_parallel_cross_entropy  # noqa: E402

TRITON = ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "triton"]
S, B, PADDED, VOCAB = 13, 3, 48, 45  # 39 tokens; vocabulary columns 45..47 are padding


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def group():
    """A one-process gloo group, for megatron-core's cross entropy (it all-reduces over its TP group) and
    mask_vocab_padding (it asks parallel_state for the TP rank)."""
    from megatron.core import parallel_state as mpu

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    mpu.set_tensor_model_parallel_rank(0)
    try:
        yield dist.group.WORLD
    finally:
        mpu.set_tensor_model_parallel_rank(None)
        dist.destroy_process_group()


def megatron_loss(logits, labels, vocab, group):
    """GPTModelWithVocab.compute_language_model_loss unfused: padding masked in place, megatron-core's vocab-parallel
    cross entropy (which upcasts to fp32), labels [b, s] -> [s, b] and the loss back to [b, s]."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from megatron_patch.models.gpt import mask_vocab_padding

    logits = mask_vocab_padding(logits, vocab)
    return vocab_parallel_cross_entropy(logits, labels.t().contiguous(), tp_group=group).t().contiguous()


def inputs(dtype, seed=0, s=S, b=B, padded=PADDED, vocab=VOCAB, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(s, b, padded, generator=g) * scale).to(dtype)
    logits[..., vocab:] += 20  # padding that would dominate the softmax if it were let in
    logits[0, 0, vocab - 1] = 4 * scale  # a row whose maximum is in the last real column (the last block)
    labels = torch.randint(0, vocab, (b, s), generator=g)
    labels[0, :3] = vocab - 1  # the last real token
    labels[1, 0] = 0
    # the gradient the training step sends back: loss mask / tokens, so per token and partly zero
    grad = torch.rand(b, s, generator=g)
    grad[2, :4] = 0
    return logits, labels, grad


def loss_and_grad(fn, logits, labels, grad, *args, **kw):
    """fn's loss [b, s] and the logits' gradient, the logits being an output layer's (non-leaf) output; also
    whether the gradient came back in the logits' own buffer."""
    leaf = logits.clone().requires_grad_()
    out = leaf * 1  # the output layer's output: a fresh non-leaf buffer
    loss = fn(out, labels, *args, **kw)
    (gl,) = torch.autograd.grad((loss * grad).sum(), [out])
    return loss.detach(), gl, gl.data_ptr() == out.data_ptr()


# fp32: the same formulas in fp32; the sum of exponentials is accumulated block by block with rescaling instead of
# once after the maximum (measured 1.2e-7): 1e-6. bf16/fp16: the logits are the same 16-bit numbers and the
# statistics fp32 in both, so the loss agrees to 1e-6 as well; the gradient is the fp32 value rounded once to the
# logits' dtype in both, so where the two fp32 values straddle a rounding boundary they differ by one step of it
# (2^-8 relative in bf16, 2^-11 in fp16; measured: bit-identical on these inputs, where a truncating cast, the
# interpreter's own, differs in about half the elements).
TOL = {torch.float32: (1e-6, 1e-6), torch.bfloat16: (1e-6, 2**-8), torch.float16: (1e-6, 2**-11)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_matches_megatron_core(dtype, group):
    logits, labels, grad = inputs(dtype)
    ref_loss, ref_grad, _ = loss_and_grad(megatron_loss, logits, labels, grad, VOCAB, group)
    tol_loss, tol_grad = TOL[dtype]
    for block in (None, 16, 8):  # 64 (one block, padded columns masked inside it); 45 real columns: 3 and 6 blocks
        loss, gl, in_place = loss_and_grad(triton_vocab_parallel_cross_entropy, logits, labels, grad, VOCAB,
                                           tp_group=group, block_size=block)
        assert loss.dtype == torch.float32 and loss.shape == (B, S) and loss.is_contiguous()
        assert gl.dtype == dtype and in_place, "the gradient is written over the logits"
        assert rel(loss, ref_loss) < tol_loss, block
        assert rel(gl, ref_grad) < tol_grad, block
        if dtype != torch.float32:  # rounded to nearest even like megatron-core's: a differing step stays rare
            assert (gl == ref_grad).double().mean() > 0.99, "16-bit gradient not rounded like torch's cast"
        assert torch.all(gl[..., VOCAB:] == 0), "padded columns get no gradient"
        assert torch.all(gl[:4, 2] == 0), "rows whose loss has gradient 0 (loss mask) get 0"
        assert gl[0, 0, VOCAB - 1] != 0  # the last real column is trained


def test_no_padding_and_one_column_blocks(group):
    """A slice without padding (all columns real), in blocks of one column and in blocks wider than the slice."""
    logits, labels, grad = inputs(torch.float32, seed=2, s=5, b=3, padded=37, vocab=37)
    ref = loss_and_grad(megatron_loss, logits, labels, grad, 37, group)
    for block in (1, 32):
        loss, gl, _ = loss_and_grad(triton_vocab_parallel_cross_entropy, logits, labels, grad, 37, block_size=block)
        assert rel(loss, ref[0]) < 1e-6 and rel(gl, ref[1]) < 1e-6, block


def test_no_gradient_without_autograd(group):
    logits, labels, _ = inputs(torch.bfloat16)
    with torch.no_grad():
        loss = triton_vocab_parallel_cross_entropy(logits.clone(), labels, VOCAB, block_size=16)
        ref = megatron_loss(logits.clone(), labels, VOCAB, group)
    assert rel(loss, ref) < 1e-6


def test_a_leaf_is_not_overwritten():
    """Logits that are a leaf (a user's tensor, not an output layer's) get a copy to take the gradient."""
    logits, labels, grad = inputs(torch.float32)
    leaf = logits.clone().requires_grad_()
    (triton_vocab_parallel_cross_entropy(leaf, labels, VOCAB) * grad).sum().backward()
    assert torch.equal(leaf.detach(), logits)
    assert leaf.grad is not None and torch.all(leaf.grad[..., VOCAB:] == 0)


def test_other_consumers_of_the_logits_are_protected():
    """The kernel writes behind autograd's back and then bumps the logits' version: an op that saved them for its
    own backward fails loudly (instead of differentiating the gradient), and a second backward is refused."""
    logits, labels, grad = inputs(torch.float32)
    out = logits.clone().requires_grad_() * 1
    side = out.sin().sum()  # saves `out`; created first, so its backward runs after the loss's
    loss = (triton_vocab_parallel_cross_entropy(out, labels, VOCAB) * grad).sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss + side).backward()
    out = logits.clone().requires_grad_() * 1
    loss = (triton_vocab_parallel_cross_entropy(out, labels, VOCAB) * grad).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="cannot be differentiated twice"):
        loss.backward()


def test_launch_config():
    assert _launch_config(50304 // 2, None)["BLOCK"] == 4096  # capped
    assert _launch_config(45, None)["BLOCK"] == 64 and _launch_config(64, None)["BLOCK"] == 64
    assert _launch_config(1, None)["BLOCK"] == 1
    with pytest.raises(ValueError, match="power of two"):
        _launch_config(45, 48)


def test_labels_layout_is_checked():
    logits, labels, _ = inputs(torch.float32)
    with pytest.raises(ValueError, match=re.escape("expected [b, s]")):
        triton_vocab_parallel_cross_entropy(logits, labels.t(), VOCAB)


# ---- tensor parallel (2 gloo processes)

def _tp_body(rank: int, group) -> dict:
    results = {"function": {}}
    # vocab 45: rank 1 holds columns 24..47, of which 45..47 are padding; vocab 20: rank 1's are all padding
    for vocab in (45, 20):
        for dtype in (torch.float32, torch.bfloat16):
            logits, labels, grad = inputs(dtype, seed=1, s=14, vocab=vocab)
            tp1 = loss_and_grad(triton_vocab_parallel_cross_entropy, logits, labels, grad, vocab)
            shard = logits.chunk(2, dim=-1)[rank]
            loss, gl, _ = loss_and_grad(triton_vocab_parallel_cross_entropy, shard, labels, grad, vocab,
                                        tp_group=group, block_size=8)
            mc_loss, mc_grad, _ = loss_and_grad(megatron_loss, shard, labels, grad, vocab, group)
            grads = [torch.empty_like(gl) for _ in range(2)]
            dist.all_gather(grads, gl.contiguous())
            full = torch.cat(grads, dim=-1)
            results["function"][f"vocab{vocab}_{str(dtype)[6:]}"] = {
                "loss_tp1": rel(loss, tp1[0]), "grad_tp1": rel(full, tp1[1]),
                "loss_megatron": rel(loss, mc_loss), "grad_megatron": rel(gl, mc_grad),
                "padded_grad": full[..., vocab:].abs().max().item()}
    # gpt.py imports the function from its module at each call, so the module's name is the one to count
    results["model"] = model_check(TP2_BASE, TRITON, "megatron_patch.models.triton_cross_entropy",
                                   "triton_vocab_parallel_cross_entropy", "triton_cross_entropy")
    return results


def test_tensor_parallel_equals_one_rank(tmp_path_factory):
    res = tp2_results_of("triton", tmp_path_factory)  # (the spawn runs test_linear_cross_entropy's TP2 body too)
    for case, r in res["function"].items():
        tol = 1e-6 if case.endswith("float32") else 2**-8  # bf16: the gradient may round to a neighbouring step
        assert r["loss_tp1"] < 1e-6 and r["loss_megatron"] < 1e-6, (case, r)
        assert r["grad_tp1"] < tol and r["grad_megatron"] < tol, (case, r)
        assert r["padded_grad"] == 0, case
    m = res["model"]
    assert m["calls_with_labels"] == 1 and m["calls_without_labels"] == 0, m
    assert m["logits_shape"] == [2, 8, 64] and m["loss_shape"] == [2, 8], m  # [b, s, padded vocabulary / TP]
    assert m["loss"] < 1e-6, m
    assert max(m["grads"].values()) < 2e-6, m


# ---- the engine (pretrain_megatron_gpt.py under torchrun, on the CPU, kernels in the interpreter)

# 100 tokens in 128 columns: the padded columns are there. fp32: the same formulas, the sum of exponentials in
# another order, so losses and grad norms agree to float rounding: 1e-5 relative.
FP32_REL = {"loss": 1e-5, "grad_norm": 1e-5, "valid": 1e-5}
SMALL = ["--vocab-size", "100", "--num-layers", "2", "--seq-length", "16", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--train-iters", "3", "--eval-interval", "3", "--eval-iters", "1"]


@pytest.mark.slow  # two engine runs, the Triton one in the interpreter: about 30 s
def test_engine_trains_like_unfused(tmp_path):
    engine_pair(tmp_path, 1, *SMALL, "--model-family", "gpt", fused_flags=TRITON,
                fused_log="loss: fused cross entropy (triton", tol=FP32_REL, iterations=3)


# ---- the GPU path, compiled without a GPU (Triton's CUDA backend and its ptxas run on the CPU)

@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_kernels_compile_for_the_gpu(dtype, monkeypatch, tmp_path):
    """The kernels as the GPU runs them (triton.jit, not the interpreter) compile for an H100 (sm_90) down to a cubin,
    at GPT-2's vocabulary at TP1 (50257 real columns of 50304, blocks of 4096), with 16-byte loads and stores (the
    padding's bound applied after the load keeps them vectorized) and one exp per element."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import megatron_patch.models.triton_cross_entropy as tce

    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    aligned = ["tt.divisibility", 16]  # what the launcher specializes torch's allocations to
    const = {"N_REAL": 50257, "N_COLS": 50304, "BLOCK": 4096}
    kernels = {
        "forward": (tce._forward_kernel, {"logits_ptr": f"*{dtype}", "labels_ptr": "*i64", "stats_ptr": "*fp32",
                                          "n_rows": "i32", "vocab_start": "i32"}, const),
        "backward": (tce._backward_kernel, {"logits_ptr": f"*{dtype}", "labels_ptr": "*i64", "max_ptr": "*fp32",
                                            "sum_ptr": "*fp32", "grad_ptr": "*fp32", "vocab_start": "i32"},
                     dict(const, TO_BF16=dtype == "bf16")),
    }
    for name, (fn, signature, constexprs) in kernels.items():
        signature = dict(signature, **{k: "constexpr" for k in constexprs})
        src = ASTSource(triton.jit(fn), signature=signature, constexprs=constexprs,
                        attrs={(i,): [aligned] for i in range(len(signature) - len(constexprs) - 1)})
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 16}).asm["ptx"]
        assert "ld.global.v4.b32" in ptx, name  # vectorized reads of the logits
        assert "ex2.approx.f32" in ptx, name
        if name == "backward":
            assert "st.global.v4.b32" in ptx  # vectorized writes of the gradient


# ---- the GPU (compiled kernels; not run on the CPU machines)

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_matches_megatron_core(dtype, group, monkeypatch):
    """GPT-2's vocabulary (50257 in 50304 columns) on CUDA, compiled kernels. Triton's exp and division are fast
    approximations there (a few ulp), torch's are not: 1e-5 in fp32; bf16 gradients within a bf16 step."""
    monkeypatch.delenv("TRITON_INTERPRET")
    logits, labels, grad = inputs(dtype, s=64, b=4, padded=50304, vocab=50257)
    logits, labels, grad = logits.cuda(), labels.cuda(), grad.cuda()
    ref_loss, ref_grad, _ = loss_and_grad(megatron_loss, logits.cpu().float(), labels.cpu(), grad.cpu(), 50257, group)
    loss, gl, in_place = loss_and_grad(triton_vocab_parallel_cross_entropy, logits, labels, grad, 50257)
    assert in_place and gl.dtype == dtype
    assert rel(loss.cpu(), ref_loss) < 1e-5
    assert rel(gl.cpu().float(), ref_grad) < (1e-5 if dtype == torch.float32 else 2**-8)
    assert torch.all(gl[..., 50257:] == 0)


# ---- flags

def test_flags(monkeypatch):
    cfg = parse_args(["--mock-data"] + TRITON).validate(1)
    assert cfg.cross_entropy_loss_fusion and cfg.cross_entropy_fusion_impl == "triton"
    assert not parse_args(["--mock-data"]).validate(1).cross_entropy_loss_fusion  # default off


@pytest.mark.parametrize("argv,match", [
    (["--cross-entropy-fusion-impl", "triton"], "takes effect only with --cross-entropy-loss-fusion"),
    (["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "tritonx"], "invalid choice"),
])
def test_flag_rejections(argv, match):
    with pytest.raises(ConfigError, match=re.escape(match)):
        parse_args(["--mock-data"] + argv).validate(1)


def test_refused_without_gpu_or_interpreter(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ConfigError, match="set TRITON_INTERPRET=1"):
        parse_args(["--mock-data"] + TRITON).validate(1)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="need a CUDA GPU"):
        parse_args(["--mock-data"] + TRITON).validate(1)


def test_bert_is_refused():
    with pytest.raises(ConfigError, match="GPT/Llama-family"):
        parse_args(["--mock-data"] + TRITON, model="bert").validate(1)
