"""The fused output layer + cross entropy (`--cross-entropy-loss-fusion --cross-entropy-fusion-impl linear`) gives
megatron-core's loss and gradients: against the plain computation (F.linear, padded vocabulary masked, fp32 cross
entropy) in fp32 and bf16 and for chunk sizes that do and do not divide the tokens; at TP2 (with and without
sequence parallelism, with a rank whose rows are all padding) against TP1; inside the GPT model (labels: the fused
path; no labels: logits); and in the engine, where a run with the switch trains like one without it."""
from __future__ import annotations

import os
import re
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loss_fusion_utils import TP2_BASE, engine_pair, model_check, rel, tp2_results_of  # noqa: E402

from megatron_patch.config import ConfigError, parse_args  # noqa: E402
from megatron_patch.models.linear_cross_entropy import chunk_tokens, linear_cross_entropy  # noqa: E402

FUSED = ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "linear"]
S, B, H, PADDED, VOCAB = 13, 3, 32, 48, 45  # 39 tokens; vocabulary rows 45..47 are padding


def plain_loss(hidden, weight, labels, vocab_size):
    """The engine's unfused path: output layer in the input dtype, .float(), padded rows -inf, cross entropy."""
    logits = F.linear(hidden, weight).float()
    logits = logits.masked_fill(torch.arange(weight.size(0)) >= vocab_size, float("-inf"))
    s, b = hidden.shape[:2]
    return F.cross_entropy(logits.reshape(s * b, -1), labels.t().reshape(-1), reduction="none").view(s, b).t()


def inputs(dtype, seed=0, s=S, b=B, padded=PADDED, vocab=VOCAB):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(s, b, H, generator=g).to(dtype)
    weight = (torch.randn(padded, H, generator=g) * 0.3).to(dtype)
    labels = torch.randint(0, vocab, (b, s), generator=g)
    labels[0, :3] = vocab - 1  # the last real token
    labels[1, 0] = 0
    # the gradient the training step sends back: loss mask / tokens, so per token and partly zero
    grad = torch.rand(b, s, generator=g)
    grad[2, :4] = 0
    return hidden, weight, labels, grad


def loss_and_grads(fn, hidden, weight, labels, grad, vocab=VOCAB, **kw):
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fn(hidden, weight, labels, vocab, **kw)
    gh, gw = torch.autograd.grad((loss * grad).sum(), [hidden, weight])
    return loss.detach(), gh, gw


# fp32: the same products, summed in another order (chunks; no rounding to a lower precision): 1e-6.
# bf16: the logits are the same bf16 numbers and the softmax is fp32 in both, so the loss still agrees to 1e-6.
# Each token's gradient row is one bf16 product in both (within 1 bf16 step, 2^-8). The weight's gradient
# sums over tokens: unfused it is one bf16 product; fused each chunk's product is rounded to bf16 once and
# the chunks summed in fp32, so it may differ by a bf16 step per chunk near the top of the range: 2^-6.
TOL = {torch.float32: (1e-6, 1e-6, 1e-6), torch.bfloat16: (1e-6, 2**-8, 2**-6)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_the_plain_computation(dtype):
    hidden, weight, labels, grad = inputs(dtype)
    ref = loss_and_grads(plain_loss, hidden, weight, labels, grad)
    tol_loss, tol_hidden, tol_weight = TOL[dtype]
    for chunk in (1, 5, 16, 39, 64):  # 5 and 16 do not divide the 39 tokens
        loss, gh, gw = loss_and_grads(linear_cross_entropy, hidden, weight, labels, grad, chunk_size=chunk)
        assert loss.dtype == torch.float32 and loss.shape == (B, S)
        assert gh.dtype == dtype and gw.dtype == dtype
        assert rel(loss, ref[0]) < tol_loss, chunk
        assert rel(gh, ref[1]) < tol_hidden, chunk
        assert rel(gw, ref[2]) < tol_weight, chunk
        assert torch.all(gw[VOCAB:] == 0), "padded rows of the vocabulary must get no gradient"
        assert gw[VOCAB - 1].abs().sum() > 0  # the last real row is trained


def test_chunk_size_bounds_the_logits():
    assert chunk_tokens(32000) == 2048  # 2048 x 32000 fp32 = 250 MiB <= 256 MiB
    assert 4 * chunk_tokens(50304) * 50304 <= 256 * 2**20
    assert chunk_tokens(10**9) == 1


def test_no_gradient_without_autograd():
    hidden, weight, labels, _ = inputs(torch.float32)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, labels, VOCAB, chunk_size=7)
    assert rel(loss, plain_loss(hidden, weight, labels, VOCAB)) < 1e-6


def test_megatron_core_output_processor_hook():
    """Canary: the wiring calls GPTModel.forward(output_processor=...), which megatron-core 0.19's _postprocess
    calls with the final hidden states, the output layer, the tied weight (or None) and the labels."""
    import inspect

    from megatron.core.models.gpt.gpt_model import GPTModel

    assert "output_processor" in inspect.signature(GPTModel.forward).parameters
    source = inspect.getsource(GPTModel._postprocess)
    for kwarg in ("hidden_states=hidden_states", "output_layer=self.output_layer", "output_weight=output_weight",
                  "labels=labels"):
        assert kwarg in source, kwarg


# ---- tensor parallel (2 gloo processes)

def _tp_body(rank: int, group) -> dict:
    import torch.distributed as dist

    results = {"function": {}}
    # vocab 45: rank 1 holds rows 24..47, of which 45..47 are padding; vocab 20: rank 1's rows are all padding
    for vocab in (45, 20):
        hidden, weight, labels, grad = inputs(torch.float32, seed=1, s=14, vocab=vocab)
        ref = loss_and_grads(linear_cross_entropy, hidden, weight, labels, grad, vocab)  # TP1, one chunk
        plain = plain_loss(hidden, weight, labels, vocab)
        shard = weight.chunk(2)[rank]
        for sp in (False, True):
            h = hidden.chunk(2)[rank] if sp else hidden  # sequence parallel: this rank's part of the sequence
            h, w = h.clone().requires_grad_(), shard.clone().requires_grad_()
            loss = linear_cross_entropy(h, w, labels, vocab, tp_group=group, sequence_parallel=sp, chunk_size=5)
            gh, gw = torch.autograd.grad((loss * grad).sum(), [h, w])
            gws = [torch.empty_like(gw) for _ in range(2)]
            dist.all_gather(gws, gw)
            full_gh = gh
            if sp:
                parts = [torch.empty_like(gh) for _ in range(2)]
                dist.all_gather(parts, gh.contiguous())
                full_gh = torch.cat(parts)
            results["function"][f"vocab{vocab}_sp{int(sp)}"] = {
                "loss": rel(loss, ref[0]), "loss_plain": rel(loss, plain), "hidden": rel(full_gh, ref[1]),
                "weight": rel(torch.cat(gws), ref[2]), "padded_weight_grad": torch.cat(gws)[vocab:].abs().max().item()}
    # GPT ties the output layer to the embedding; gpt.py calls linear_cross_entropy by its imported name
    results["model"] = model_check(TP2_BASE, FUSED, "megatron_patch.models.gpt", "linear_cross_entropy",
                                   "fused_linear_cross_entropy")
    return results


def test_tensor_parallel_equals_one_rank(tmp_path_factory):
    res = tp2_results_of("linear", tmp_path_factory)  # (the spawn runs test_triton_cross_entropy's TP2 body too)
    for case, r in res["function"].items():
        assert r["loss"] < 1e-6 and r["loss_plain"] < 1e-6, (case, r)
        assert r["hidden"] < 1e-6 and r["weight"] < 1e-6, (case, r)
        assert r["padded_weight_grad"] == 0, case
    m = res["model"]
    assert m["calls_with_labels"] == 1 and m["calls_without_labels"] == 0, m
    assert m["logits_shape"] == [2, 8, 64], m  # [b, s, padded vocabulary / TP]
    assert m["loss"] < 1e-6, m
    assert max(m["grads"].values()) < 2e-6, m
    # GPT ties the output layer to the embedding: the fused loss's weight gradient arrives there
    assert "embedding.word_embeddings.weight" in m["grads"] and "output_layer.weight" not in m["grads"]


# ---- the engine (pretrain_megatron_gpt.py under torchrun, on the CPU)

# 100 tokens in 128 rows: the padded rows are there. In fp32 the fused path sums the same numbers in another
# order, so losses and grad norms agree to float rounding (measured: at most 5e-7 absolute): 1e-5 relative.
# In bf16 the softmax is fp32 in both but computed as exp(x - logsumexp) instead of exp(x - max) / sum: a last-bit
# difference that now and then rounds a logit's gradient to the neighbouring bf16 value (2^-8 apart), and
# the weights then drift apart by bf16 steps (measured over 5 steps: loss 2.5e-5, grad norm 2.2e-4 relative).
FP32_REL = {"loss": 1e-5, "grad_norm": 1e-5, "valid": 1e-5}
BF16_REL = {"loss": 1e-4, "grad_norm": 1e-3, "valid": 1e-4}
FUSED_LOG = "loss: fused output layer + cross entropy (linear"


def linear_pair(tmp_path, nproc, *args, **kw):
    """loss_fusion_utils.engine_pair with the linear impl's flags, log line and fp32 tolerance as defaults."""
    return engine_pair(tmp_path, nproc, *args, **{"fused_flags": FUSED, "fused_log": FUSED_LOG, "tol": FP32_REL, **kw})


@pytest.mark.slow  # two engine runs: about 16 s
def test_engine_gpt_tied_trains_like_unfused(tmp_path):
    linear_pair(tmp_path, 1, "--model-family", "gpt")


@pytest.mark.slow
def test_engine_llama_untied_trains_like_unfused(tmp_path):
    linear_pair(tmp_path, 1, "--model-family", "llama")


@pytest.mark.slow
def test_engine_tp2_sequence_parallel_trains_like_unfused(tmp_path):
    linear_pair(tmp_path, 2, "--model-family", "gpt", "--tensor-model-parallel-size", "2", "--sequence-parallel")


@pytest.mark.slow
def test_engine_bf16_trains_like_unfused(tmp_path):
    linear_pair(tmp_path, 1, "--model-family", "gpt", "--bf16", tol=BF16_REL)


@pytest.mark.slow
def test_engine_native_fusion_is_megatron_cores(tmp_path):
    """--cross-entropy-loss-fusion alone is Megatron-LM's default impl, native: megatron-core's fused cross entropy
    of the (masked) logits, passed through to its TransformerConfig (bf16 only, see validate). On the CPU its
    torch.compile makes this test take about 40 s."""
    linear_pair(tmp_path, 1, "--model-family", "gpt", "--bf16", fused_flags=["--cross-entropy-loss-fusion"],
                fused_log="loss: fused cross entropy (native)", tol=BF16_REL)


# ---- flags

def test_flags_follow_megatron_lm():
    cfg = parse_args(["--mock-data"] + FUSED).validate(1)
    assert cfg.cross_entropy_loss_fusion and cfg.cross_entropy_fusion_impl == "linear"
    assert parse_args(["--mock-data", "--bf16", "--cross-entropy-loss-fusion"]).validate(1).cross_entropy_loss_fusion
    cfg = parse_args(["--mock-data"]).validate(1)
    assert not cfg.cross_entropy_loss_fusion and cfg.cross_entropy_fusion_impl == "native"  # Megatron-LM's defaults


@pytest.mark.parametrize("argv,match", [
    (["--cross-entropy-fusion-impl", "linear"], "takes effect only with --cross-entropy-loss-fusion"),
    (["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "chunked"], "invalid choice"),
    (["--cross-entropy-loss-fusion"], "returns the gradient of the logits in bf16"),
    (["--cross-entropy-loss-fusion", "--fp16"], "returns the gradient of the logits in bf16"),
])
def test_flag_rejections(argv, match):
    with pytest.raises(ConfigError, match=re.escape(match)):
        parse_args(["--mock-data"] + argv).validate(1)


def test_bert_is_refused():
    with pytest.raises(ConfigError, match="GPT/Llama-family"):
        parse_args(["--mock-data"] + FUSED, model="bert").validate(1)
