"""--moe-grouped-gemm (models/grouped_experts.py): the experts of an MoE layer as two torch._grouped_mm calls.

Here: the grouped computation against one plain matmul pair per expert (outputs and every gradient, an expert
with no tokens among them). The engine against megatron-core's SequentialMLP, EP2, and checkpoints across the
two paths are in tests/test_moe.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megatron_patch.models.grouped_experts import grouped_expert_mlp

HIDDEN, FFN = 16, 24


def _experts(num: int, glu: bool, dtype: torch.dtype, seed: int = 0) -> SimpleNamespace:
    """What grouped_expert_mlp reads of a SequentialMLP: its config and each expert's two weights."""
    g = torch.Generator().manual_seed(seed)
    config = SimpleNamespace(gated_linear_unit=glu, activation_func=F.silu if glu else F.gelu,
                             activation_func_clamp_value=None, glu_linear_offset=0.0, moe_apply_probs_on_input=False)
    local = []
    for _ in range(num):
        w1 = torch.randn((2 if glu else 1) * FFN, HIDDEN, generator=g) * 0.3
        w2 = torch.randn(HIDDEN, FFN, generator=g) * 0.3
        local.append(SimpleNamespace(linear_fc1=SimpleNamespace(weight=w1.to(dtype).requires_grad_()),
                                     linear_fc2=SimpleNamespace(weight=w2.to(dtype).requires_grad_())))
    return SimpleNamespace(config=config, local_experts=local, num_local_experts=num)


def _per_expert(experts, x, counts, probs):
    """MLP.forward of each expert over its own rows, as SequentialMLP runs them."""
    outs = []
    for e, xe, pe in zip(experts.local_experts, torch.split(x, counts), torch.split(probs, counts)):
        h = xe @ e.linear_fc1.weight.t()
        if experts.config.gated_linear_unit:
            a, b = torch.chunk(h, 2, dim=-1)
            h = F.silu(a) * b
        else:
            h = F.gelu(h)
        h = (h * pe.unsqueeze(-1)).to(h.dtype)
        outs.append(h @ e.linear_fc2.weight.t())
    return torch.cat(outs)


def _grads(tensors):
    return [t.grad.clone() for t in tensors]


@pytest.mark.parametrize("glu", [True, False], ids=["swiglu", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_expert_mlp_matches_a_matmul_pair_per_expert(glu, dtype):
    counts = [5, 0, 9, 3]  # expert 1 receives no token
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(counts), HIDDEN, generator=g).to(dtype)
    probs = torch.rand(sum(counts), generator=g)  # the routers' probabilities are fp32
    dy = torch.randn(sum(counts), HIDDEN, generator=g).to(dtype)
    results = []
    for fn in (grouped_expert_mlp, None):
        experts = _experts(len(counts), glu, dtype)
        xi, pi = x.clone().requires_grad_(), probs.clone().requires_grad_()
        if fn is None:
            out = _per_expert(experts, xi, counts, pi)
        else:
            out, bias = fn(experts, xi, torch.tensor(counts), pi)
            assert bias is None
        out.backward(dy)
        weights = [w for e in experts.local_experts for w in (e.linear_fc1.weight, e.linear_fc2.weight)]
        results.append((out.detach(), xi.grad, pi.grad, _grads(weights)))
    (out, gx, gp, gw), (ref, rx, rp, rw) = results
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    assert out.dtype == dtype and out.shape == (sum(counts), HIDDEN)
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(gx, rx, **tol)
    torch.testing.assert_close(gp, rp, **tol)
    for i, (a, b) in enumerate(zip(gw, rw)):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, i=i: f"expert {i // 2} fc{i % 2 + 1}: {m}")
    assert not gw[2].any() and not gw[3].any()  # the expert without tokens gets zero gradients


def test_probabilities_on_the_input_as_upstream():
    """moe_apply_probs_on_input (top-1): the probability scales the expert's input, not its activation."""
    counts = [4, 6]
    g = torch.Generator().manual_seed(2)
    x, probs = torch.randn(10, HIDDEN, generator=g), torch.rand(10, generator=g)
    experts = _experts(2, True, torch.float32)
    experts.config.moe_apply_probs_on_input = True
    out, _ = grouped_expert_mlp(experts, x, torch.tensor(counts), probs)
    experts.config.moe_apply_probs_on_input = False
    want = _per_expert(experts, probs.unsqueeze(-1) * x, counts, torch.ones(10))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def test_backward_keeps_the_parameters_not_a_stacked_copy():
    """What the grouped path saves for backward (beyond the parameters themselves) is no more than what the
    per-expert matmuls save: autograd around torch.stack would keep a copy of every expert weight per micro
    batch (39 MiB instead of 6 MiB with 8 experts of 512 x 1408 and 512 tokens)."""
    def saved_bytes(fn):
        experts = _experts(8, True, torch.bfloat16)
        params = {w.data_ptr() for e in experts.local_experts for w in (e.linear_fc1.weight, e.linear_fc2.weight)}
        seen = {}

        def pack(t):
            if t.data_ptr() not in params:
                seen[(t.data_ptr(), tuple(t.shape))] = t.numel() * t.element_size()
            return t

        x, probs = torch.randn(64, HIDDEN, dtype=torch.bfloat16), torch.rand(64)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(experts, x.requires_grad_(), [8] * 8, probs)
        return sum(seen.values())

    grouped = saved_bytes(lambda e, x, c, p: grouped_expert_mlp(e, x, torch.tensor(c), p)[0])
    assert grouped <= saved_bytes(_per_expert) + 8 * 4, grouped  # + the group offsets, an int32 per expert
