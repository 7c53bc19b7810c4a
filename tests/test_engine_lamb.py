"""megatron_patch.accelerations.lamb.Lamb against a plain, element-by-element reference of its documented formula."""
import math

import torch

from megatron_patch.accelerations.lamb import Lamb


def reference_lamb_step(p, g, m, v, t, lr, b1, b2, eps, wd):
    """One LAMB step of one tensor given as lists of floats; returns the new (p, m, v)."""
    m = [b1 * mi + (1 - b1) * gi for mi, gi in zip(m, g)]
    v = [b2 * vi + (1 - b2) * gi * gi for vi, gi in zip(v, g)]
    r = [(mi / (1 - b1**t)) / (math.sqrt(vi / (1 - b2**t)) + eps) + wd * pi for mi, vi, pi in zip(m, v, p)]
    p_norm = math.sqrt(sum(x * x for x in p))
    r_norm = math.sqrt(sum(x * x for x in r))
    trust = p_norm / r_norm if p_norm > 0 and r_norm > 0 else 1.0
    return [pi - lr * trust * ri for pi, ri in zip(p, r)], m, v


def test_lamb_matches_the_reference_over_several_steps():
    torch.manual_seed(0)
    b1, b2, eps = 0.9, 0.99, 1e-6
    weight = torch.randn(3, 4, dtype=torch.float64)
    bias = torch.zeros(4, dtype=torch.float64)  # ||p|| = 0 at step 1: trust 1
    frozen = torch.randn(5, dtype=torch.float64)  # zero gradient, no decay: ||r|| = 0, trust 1, no move
    other = torch.randn(2, 3, dtype=torch.float64)
    groups = [  # (tensors, lr, weight decay), as megatron-core's decay / no-decay groups
        ([weight, bias], 0.05, 0.1),
        ([frozen, other], 0.02, 0.0),
    ]
    params = [torch.nn.Parameter(t.clone()) for ts, _, _ in groups for t in ts]
    opt = Lamb([{"params": params[0:2], "lr": 0.05, "weight_decay": 0.1},
                {"params": params[2:4], "lr": 0.02, "weight_decay": 0.0}], betas=(b1, b2), eps=eps)
    ref = [(t.flatten().tolist(), [0.0] * t.numel(), [0.0] * t.numel(), lr, wd)
           for ts, lr, wd in groups for t in ts]
    for t in range(1, 5):
        grads = [torch.randn_like(p) for p in params]
        grads[2].zero_()
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        for i, (g, (rp, rm, rv, lr, wd)) in enumerate(zip(grads, ref)):
            rp, rm, rv = reference_lamb_step(rp, g.flatten().tolist(), rm, rv, t, lr, b1, b2, eps, wd)
            ref[i] = (rp, rm, rv, lr, wd)
            want = torch.tensor(rp, dtype=torch.float64).view_as(params[i])
            torch.testing.assert_close(params[i].detach(), want, rtol=1e-12, atol=1e-14,
                                       msg=lambda m, i=i, t=t: f"tensor {i} after step {t}: {m}")
    assert params[1].abs().min() > 0  # the zero bias did move (trust 1, not 0)
    torch.testing.assert_close(params[2].detach(), frozen)  # nothing to apply
    assert not torch.allclose(params[0].detach(), weight)
