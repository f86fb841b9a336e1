"""Independent references shared by the tests: optimizers written out without the DSL."""

from __future__ import annotations

import torch

__all__ = ["ADAMAX", "LionFormula"]


class LionFormula(torch.optim.Optimizer):
    """Lion as Chen et al. (2023) / lucidrains/lion-pytorch write it, independent of the DSL."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                c = b1 * m + (1 - b1) * p.grad
                p.mul_(1 - group["lr"] * group["weight_decay"]).add_(torch.sign(c), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


class LambFormula(torch.optim.Optimizer):
    """LAMB as You et al. (ICLR 2020) write it in Algorithm 2 (phi the identity; a trust ratio of 1 where either
    norm is zero), independent of the DSL."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                t = state["step"] = state.get("step", 0) + 1
                m = state.setdefault("exp_avg", torch.zeros_like(p))
                v = state.setdefault("exp_avg_sq", torch.zeros_like(p))
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                r = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + group["eps"])
                u = r + group["weight_decay"] * p
                w_norm, u_norm = p.norm(), u.norm()
                trust = (w_norm / u_norm).item() if w_norm > 0 and u_norm > 0 else 1.0
                p.add_(u, alpha=-group["lr"] * trust)


# Adamax as a user would write it: a new optimizer needs no compiler change.
ADAMAX = """
# Adamax (Kingma & Ba, 2015, section 7.1), as torch.optim.Adamax computes it.
optimizer adamax "torch.optim.Adamax"
hyper lr = 2e-3 in [0, inf)
hyper betas = (beta1 = 0.9, beta2 = 0.999) in [0, 1)
hyper eps = 1e-8 in [0, inf)
hyper weight_decay = 0 in [0, inf)
flag maximize = false
state exp_avg = 0
state exp_inf = 0 nonneg
update {
    g = where(maximize, -grad, grad) + weight_decay * param
    exp_avg = exp_avg + (1 - beta1) * (g - exp_avg)
    exp_inf = max(beta2 * exp_inf, abs(g) + eps)
    param = param - lr / (1 - beta1 ** step) * exp_avg / exp_inf
}
"""
