"""LAMB (You et al., 2019) as a torch optimizer, for `--optimizers apex_lamb` when apex is absent.

Per parameter: Adam moments with bias correction, the update r = m_hat / (sqrt(v_hat) + eps) + wd * p,
then p -= lr * trust * r with trust = ||p|| / ||r|| (1 when either norm is zero), apex's FusedLAMB
without its global gradient-norm clipping (megatron-core clips before the step).
"""
from __future__ import annotations

import torch


class Lamb(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            b1, b2 = group["betas"]
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            states = [self.state[p] for p in params]
            for p, s in zip(params, states):
                if not s:
                    s["step"] = 0
                    s["exp_avg"] = torch.zeros_like(p)
                    s["exp_avg_sq"] = torch.zeros_like(p)
                s["step"] += 1
            m = [s["exp_avg"] for s in states]
            v = [s["exp_avg_sq"] for s in states]
            torch._foreach_mul_(m, b1)
            torch._foreach_add_(m, grads, alpha=1 - b1)
            torch._foreach_mul_(v, b2)
            torch._foreach_addcmul_(v, grads, grads, value=1 - b2)
            for p, s, mi, vi in zip(params, states, m, v):
                t = s["step"]
                update = (mi / (1 - b1**t)) / ((vi / (1 - b2**t)).sqrt() + group["eps"])
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                w_norm, u_norm = p.norm(), update.norm()
                trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
                p.add_(update * trust, alpha=-group["lr"])
        return loss
