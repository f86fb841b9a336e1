"""The runtime side of the language's idioms (docs/LANGUAGE.md): states that start from the weights,
states that must stay exact, and initial values read when the optimizer is built.

Each is checked against a hand-written torch loop in float64 (the reference step), and through the
kernels (the Triton interpreter without a GPU) against the reference step.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import forge_dsl
from forge_dsl import kernels
from forge_dsl.testing import rel_err

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Schedule-free SGD's shape (Defazio et al. 2024): z takes the gradient steps, the weight is an
# average of z that moves toward it; z starts as a copy of the weight.
SCHEDULE_FREE = """\
optimizer sf_sgd "schedule-free SGD, its y = x form"
hyper lr = 1e-2 in [0, inf)
hyper beta = 0.9 in [0, 1)
state z = param
state m = 0
update {
    m = beta * m + (1 - beta) * grad
    z = z - lr * m
    param = beta * param + (1 - beta) * z
}
"""

# MADGRAD-style: x0 is the weight at the start, read at every step.
ANCHORED = """\
optimizer anchored "pull toward the initial weights"
hyper lr = 1e-2 in [0, inf)
hyper pull = 0.1 in [0, 1]
state x0 = -param
update {
    x0 = x0
    param = param - lr * grad - pull * (param + x0)
}
"""

# AdaBound keeps the learning rate the optimizer was built with (base_lr) and bounds the step by
# final_lr * lr / base_lr: under a warm-up schedule lr changes, base_lr must not.
BASE_LR = """\
optimizer base_lr_sgd "SGD scaled by lr / base_lr, base_lr read when the optimizer is built"
hyper lr = 1e-2 in [0, inf)
scalar base_lr = lr
update {
    base_lr = base_lr
    param = param - lr * (lr / base_lr) * grad
}
"""


@pytest.fixture
def spec_file(tmp_path):
    def write(text: str) -> str:
        name = text.split()[1]
        path = tmp_path / f"{name}.fopt"
        path.write_text(text)
        return str(path)

    return write


def schedule_free_torch(p0: torch.Tensor, grads: list[torch.Tensor], lr: float, beta: float) -> torch.Tensor:
    p, z, m = p0.clone(), p0.clone(), torch.zeros_like(p0)
    for g in grads:
        m = beta * m + (1 - beta) * g
        z = z - lr * m
        p = beta * p + (1 - beta) * z
    return p


def test_state_from_param_starts_as_a_copy_in_every_layout(spec_file):
    spec = forge_dsl.load_spec(spec_file(SCHEDULE_FREE))
    p = torch.randn(5, 130)
    for layout in (None, "fp32", "bf16", "int8"):
        state = forge_dsl.init_state(spec, p, layout=layout)
        assert torch.equal(state["z"], p) and state["z"].data_ptr() != p.data_ptr(), layout
        assert state["z"].dtype == torch.float32, layout  # exact: never bf16 or int8
    assert forge_dsl.init_state(spec, p, layout="int8")["m"].dtype == torch.int8  # the others follow the layout
    neg = forge_dsl.init_state(spec_file(ANCHORED), p.double())
    assert torch.equal(neg["x0"], -p.double())


def test_a_layout_dict_cannot_quantize_a_state_that_must_stay_exact(spec_file):
    spec = forge_dsl.load_spec(spec_file(SCHEDULE_FREE))
    with pytest.raises(ValueError, match=r"state 'z' of sf_sgd must stay in fp32 because it starts from param"):
        forge_dsl.init_state(spec, torch.randn(4, 64), layout={"z": "int8"})
    exact = spec_file(SCHEDULE_FREE.replace("optimizer sf_sgd", "optimizer sf_exact")
                      .replace("state m = 0", "state m = 0 exact"))
    with pytest.raises(ValueError, match=r"state 'm' of sf_exact must stay in fp32 because it is declared exact"):
        forge_dsl.init_state(exact, torch.randn(4, 64), layout={"m": "bf16"})
    assert forge_dsl.init_state(exact, torch.randn(4, 64), layout="bf16")["m"].dtype == torch.float32


def test_reference_step_of_a_state_from_param_matches_a_torch_loop(spec_file):
    spec = forge_dsl.load_spec(spec_file(SCHEDULE_FREE))
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(6, 20, generator=gen, dtype=torch.float64)
    grads = [torch.randn(6, 20, generator=gen, dtype=torch.float64) for _ in range(5)]
    expected = schedule_free_torch(p, grads, lr=0.05, beta=0.8)
    state = forge_dsl.init_state(spec, p, lr=0.05, beta=0.8)
    for step, g in enumerate(grads, 1):
        forge_dsl.reference_step(spec, p, g, state, step=step, lr=0.05, beta=0.8)
    assert torch.allclose(p, expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("layout", ["fp32", "int8"])
def test_kernels_keep_a_state_from_param_exact(spec_file, layout):
    """The fused kernel with int8 state (m quantized, z fp32) against the float64 reference, 4 steps; z,
    a weight-like value, must be within fp32 rounding of the reference, which int8 could not be."""
    spec = forge_dsl.load_spec(spec_file(SCHEDULE_FREE))
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(40, 136, generator=gen).to(DEVICE)
    state = forge_dsl.init_state(spec, w, layout=layout, lr=0.05)
    ref_w = w.double().cpu()
    ref_state = forge_dsl.init_state(spec, ref_w, lr=0.05)
    for step in range(1, 5):
        x = torch.randn(24, 136, generator=gen)
        dy = torch.randn(24, 40, generator=gen) * 0.1
        kernels.fused_linear_step(spec, x.to(DEVICE), dy.to(DEVICE), w, state, step=step, lr=0.05)
        forge_dsl.reference_step(spec, ref_w, dy.double().T @ x.double(), ref_state, step=step, lr=0.05)
        if layout == "int8":  # resynchronise the quantized m, as tests/kernels/test_kernels.py does
            ref_state["m"] = forge_dsl.testing.as_float64_state(state, spec)["m"]
    assert state["z"].dtype == torch.float32
    assert rel_err(state["z"], ref_state["z"]) <= 1e-5
    assert rel_err(w, ref_w) <= 1e-5


def test_initial_values_read_the_hyperparameters_the_optimizer_was_built_with(spec_file):
    """Under a LinearLR warm-up (lr starts at 0.1 × lr), base_lr is the lr given to the constructor, so the
    first update is 0.1 lr × 0.1 × grad, not 0.1 lr × 1 × grad (what reading it at the first step gives)."""
    torch.manual_seed(0)
    model = nn.Linear(64, 72, bias=True).to(DEVICE)
    lr = 0.05
    opt = forge_dsl.ForgeOptimizer(model, spec_file(BASE_LR), lr=lr)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=4)
    w0, b0 = model.weight.detach().clone(), model.bias.detach().clone()
    x = torch.randn(16, 64, device=DEVICE)
    model(x).square().sum().backward()  # the weight is updated in backward, the bias in step()
    grad_b = model.bias.grad.clone()
    dw = (2 * (x @ w0.T + b0)).T @ x
    opt.step()
    sched.step()
    cur = 0.1 * lr
    assert torch.allclose(model.bias.detach(), b0 - cur * (cur / lr) * grad_b, rtol=1e-6, atol=1e-7)
    assert rel_err(model.weight.detach() - w0, -cur * (cur / lr) * dw) <= 1e-4
    assert float(opt.state[model.bias]["base_lr"]) == lr
    assert opt.param_groups[0]["_forge_initial"] == {"lr": lr}
    restored = forge_dsl.ForgeOptimizer(nn.Linear(64, 72).to(DEVICE), spec_file(BASE_LR), lr=1.0)
    restored.load_state_dict(opt.state_dict())
    assert restored.param_groups[0]["_forge_initial"] == {"lr": lr}


# AdEMAMix (Pagliardini et al. 2024) with torch-style keywords: t_alpha_beta3=None (the default) keeps
# alpha and beta3 fixed; a number ramps alpha up and beta3's half-life out over that many steps.
ADEMAMIX = """\
optimizer ademamix "AdEMAMix"
hyper lr = 1e-3 in [0, inf)
hyper betas = (beta1 = 0.9, beta2 = 0.999, beta3 = 0.9999) in [0, 1)
hyper alpha = 2 in [0, inf)
hyper t_alpha_beta3 = none in [1, inf)
hyper eps = 1e-8 in [0, inf)
hyper weight_decay = 0 in [0, inf)
flag scheduled = given(t_alpha_beta3)
state exp_avg = 0
state exp_avg_slow = 0
state exp_avg_sq = 0 nonneg
update {
    if scheduled {
        frac = min(step / t_alpha_beta3, 1)
        alpha_t = frac * alpha
        beta3_t = min(exp(log(beta1) * log(beta3) / ((1 - frac) * log(beta3) + frac * log(beta1))), beta3)
    } else {
        alpha_t = alpha
        beta3_t = beta3
    }
    param = param * (1 - lr * weight_decay)
    exp_avg = beta1 * exp_avg + (1 - beta1) * grad
    exp_avg_slow = beta3_t * exp_avg_slow + (1 - beta3_t) * grad
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
    denom = sqrt(exp_avg_sq) / sqrt(1 - beta2 ** step) + eps
    param = param - lr * (exp_avg / (1 - beta1 ** step) + alpha_t * exp_avg_slow) / denom
}
"""


def ademamix_torch(p, grads, lr, betas, alpha, t, eps, wd):
    import math

    b1, b2, b3 = betas
    m1, m2, nu = torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p)
    p = p.clone()
    for step, g in enumerate(grads, 1):
        if t is None:
            alpha_t, b3_t = alpha, b3
        else:
            frac = min(step / t, 1.0)
            alpha_t = frac * alpha
            b3_t = min(math.exp(math.log(b1) * math.log(b3) / ((1 - frac) * math.log(b3) + frac * math.log(b1))), b3)
        p = p * (1 - lr * wd)
        m1 = b1 * m1 + (1 - b1) * g
        m2 = b3_t * m2 + (1 - b3_t) * g
        nu = b2 * nu + (1 - b2) * g * g
        denom = nu.sqrt() / math.sqrt(1 - b2**step) + eps
        p = p - lr * (m1 / (1 - b1**step) + alpha_t * m2) / denom
    return p


@pytest.mark.parametrize("t_alpha_beta3", [None, 3.0])
def test_optional_hyperparameter_none_or_given(spec_file, t_alpha_beta3):
    spec = forge_dsl.load_spec(spec_file(ADEMAMIX))
    kw = dict(lr=1e-2, betas=(0.8, 0.99, 0.95), alpha=3.0, weight_decay=0.1)
    if t_alpha_beta3 is not None:
        kw["t_alpha_beta3"] = t_alpha_beta3
    gen = torch.Generator().manual_seed(2)
    p = torch.randn(8, 70, generator=gen, dtype=torch.float64)
    grads = [torch.randn(8, 70, generator=gen, dtype=torch.float64) for _ in range(5)]
    expected = ademamix_torch(p, grads, 1e-2, (0.8, 0.99, 0.95), 3.0, t_alpha_beta3, 1e-8, 0.1)
    ref_p, ref_state = p.clone(), forge_dsl.init_state(spec, p, **kw)
    w = p.float().to(DEVICE)
    state = forge_dsl.init_state(spec, w, layout="fp32", **kw)
    for step, g in enumerate(grads, 1):
        forge_dsl.reference_step(spec, ref_p, g, ref_state, step=step, **kw)
        kernels.step(spec, w, g.float().to(DEVICE), state, step=step, **kw)
    assert torch.allclose(ref_p, expected, rtol=1e-12, atol=1e-14)
    assert rel_err(w, ref_p) <= 1e-5
    with_none = forge_dsl.init_state(spec, p, t_alpha_beta3=None)  # None passed explicitly is the default
    assert set(with_none) == set(ref_state)


def test_exact_states_are_float32_even_beside_bf16_weights_and_the_kernels_refuse_them_quantized(spec_file):
    spec = forge_dsl.load_spec(spec_file(SCHEDULE_FREE))
    w = torch.randn(8, 64).to(torch.bfloat16).to(DEVICE)
    plain = forge_dsl.init_state(spec, w)  # layout None: the weight's dtype, but an exact state stays float32
    assert plain["z"].dtype == torch.float32 and plain["m"].dtype == torch.bfloat16
    assert torch.equal(plain["z"], w.float())
    bad = dict(plain, z=plain["z"].to(torch.bfloat16))
    g = torch.randn(8, 64).to(torch.bfloat16).to(DEVICE)
    with pytest.raises(ValueError, match=r"state 'z' of sf_sgd must stay exact .* stored as torch.bfloat16"):
        kernels.step(spec, w, g, bad, step=1)
    kernels.step(spec, w, g, plain, step=1)  # the float32 one runs
