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
