"""reference_step (float64) against torch.optim, over consecutive steps with fresh gradients.

Hypothesis draws hyperparameters inside their valid ranges and every flag
combination; each example runs several steps with new random gradients.
Lion has no torch.optim counterpart: it is checked against the formula of
Chen et al. (2023) written out here.
"""

from __future__ import annotations


import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import forge_dsl
from references import LambFormula, LionFormula

REL_TOL = 1e-10
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

unit = st.floats(0.0, 0.999)
small = st.floats(0.0, 0.2)
lr = st.floats(1e-4, 0.1)
eps = st.sampled_from([1e-8, 1e-6, 1e-3, 0.1])
shape = st.tuples(st.integers(1, 9), st.integers(1, 13))
seed = st.integers(0, 2**31 - 1)
steps = st.integers(5, 9)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    denom = b.norm().item()
    diff = (a - b).norm().item()
    if denom == 0:
        return diff
    return diff / denom


def run_against(spec_name, torch_factory, kwargs, state_names, shape, seed, steps, reference_state=None,
                check_states=None):
    """Step a float64 parameter with reference_step and with torch; compare param and states each step (the
    states named alike, and `check_states(opt, theirs, state)` where they are not)."""
    # torch keeps scalar state (step, NAdam's mu_product) in the default dtype: make it float64 too.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        _run_against(spec_name, torch_factory, kwargs, state_names, shape, seed, steps, reference_state,
                     check_states)
    finally:
        torch.set_default_dtype(previous)


def _run_against(spec_name, torch_factory, kwargs, state_names, shape, seed, steps, reference_state, check_states):
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(shape, generator=gen, dtype=torch.float64)
    ours = p0.clone()
    theirs = p0.clone().requires_grad_(True)
    opt = torch_factory([theirs], **kwargs)
    state = forge_dsl.init_state(spec_name, ours, **kwargs)
    if reference_state is not None:
        reference_state(opt, theirs, state)
    for step in range(1, steps + 1):
        grad = torch.randn(shape, generator=gen, dtype=torch.float64) * (0.1 + step)
        forge_dsl.reference_step(spec_name, ours, grad, state, step=step, **kwargs)
        theirs.grad = grad.clone()
        opt.step()
        with torch.no_grad():
            err = rel_err(ours, theirs.detach())
            assert err <= REL_TOL, f"step {step}: param relative error {err:.3e} > {REL_TOL}"
            for name in state_names:
                if name in opt.state[theirs]:
                    ref = opt.state[theirs][name]
                    assert name in state, f"state {name} missing"
                    err = rel_err(state[name].to(torch.float64), torch.as_tensor(ref, dtype=torch.float64))
                    assert err <= REL_TOL, f"step {step}: state {name} relative error {err:.3e}"
            if check_states is not None:
                check_states(opt, theirs, state)


@SETTINGS
@given(lr=lr, b1=unit, b2=unit, eps=eps, wd=small, amsgrad=st.booleans(), maximize=st.booleans(),
       shape=shape, seed=seed, steps=steps)
def test_adamw(lr, b1, b2, eps, wd, amsgrad, maximize, shape, seed, steps):
    kw = dict(lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, amsgrad=amsgrad, maximize=maximize)
    run_against("adamw", torch.optim.AdamW, kw, ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"], shape, seed, steps)


@SETTINGS
@given(lr=lr, b1=unit, b2=unit, eps=eps, wd=small, md=st.floats(0.0, 0.1), dwd=st.booleans(),
       maximize=st.booleans(), shape=shape, seed=seed, steps=steps)
def test_nadam(lr, b1, b2, eps, wd, md, dwd, maximize, shape, seed, steps):
    kw = dict(lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, momentum_decay=md,
              decoupled_weight_decay=dwd, maximize=maximize)
    run_against("nadam", torch.optim.NAdam, kw, ["exp_avg", "exp_avg_sq", "mu_product"], shape, seed, steps)


@SETTINGS
@given(lr=lr, b1=unit, b2=unit, eps=eps, wd=small, dwd=st.booleans(), maximize=st.booleans(),
       shape=shape, seed=seed, steps=st.integers(5, 12))
# beta2 = 0.9: rho_t crosses 5 at step 6, so both branches of the rectification run.
@example(lr=1e-2, b1=0.9, b2=0.9, eps=1e-8, wd=0.01, dwd=False, maximize=False, shape=(3, 4), seed=1, steps=12)
def test_radam(lr, b1, b2, eps, wd, dwd, maximize, shape, seed, steps):
    kw = dict(lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, decoupled_weight_decay=dwd, maximize=maximize)
    run_against("radam", torch.optim.RAdam, kw, ["exp_avg", "exp_avg_sq"], shape, seed, steps)


@SETTINGS
# alpha near 0 with centered=True makes square_avg - grad_avg**2 cancel catastrophically (ill-conditioned
# in any implementation), so alpha is drawn where the quantity is well-conditioned.
@given(lr=lr, alpha=st.floats(0.5, 0.999), eps=eps, wd=small, momentum=st.sampled_from([0.0, 0.5, 0.9]),
       centered=st.booleans(), maximize=st.booleans(), shape=shape, seed=seed, steps=steps)
def test_rmsprop(lr, alpha, eps, wd, momentum, centered, maximize, shape, seed, steps):
    kw = dict(lr=lr, alpha=alpha, eps=eps, weight_decay=wd, momentum=momentum, centered=centered,
              maximize=maximize)
    run_against("rmsprop", torch.optim.RMSprop, kw, ["square_avg", "grad_avg", "momentum_buffer"],
                shape, seed, steps)


@SETTINGS
@given(lr=lr, lr_decay=st.floats(0.0, 0.5), wd=small, iav=st.floats(0.0, 1.0), eps=st.sampled_from([1e-10, 1e-6]),
       maximize=st.booleans(), shape=shape, seed=seed, steps=steps)
def test_adagrad(lr, lr_decay, wd, iav, eps, maximize, shape, seed, steps):
    kw = dict(lr=lr, lr_decay=lr_decay, weight_decay=wd, initial_accumulator_value=iav, eps=eps,
              maximize=maximize)
    run_against("adagrad", torch.optim.Adagrad, kw, ["sum"], shape, seed, steps)


@SETTINGS
@given(lr=lr, wd=small, maximize=st.booleans(), shape=shape, seed=seed, steps=steps)
def test_sgd(lr, wd, maximize, shape, seed, steps):
    kw = dict(lr=lr, weight_decay=wd, maximize=maximize)
    run_against("sgd", torch.optim.SGD, kw, [], shape, seed, steps)


@SETTINGS
@given(lr=lr, momentum=st.floats(0.01, 0.99), dampening=st.floats(0.0, 0.9), wd=small,
       nesterov=st.booleans(), maximize=st.booleans(), shape=shape, seed=seed, steps=steps)
def test_sgd_momentum(lr, momentum, dampening, wd, nesterov, maximize, shape, seed, steps):
    if nesterov:
        dampening = 0.0
    kw = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=wd, nesterov=nesterov,
              maximize=maximize)
    run_against("sgd_momentum", torch.optim.SGD, kw, ["momentum_buffer"], shape, seed, steps)


@SETTINGS
@given(lr=lr, b1=st.floats(0.0, 1.0), b2=st.floats(0.0, 1.0), wd=small, shape=shape, seed=seed, steps=steps)
def test_lion(lr, b1, b2, wd, shape, seed, steps):
    kw = dict(lr=lr, betas=(b1, b2), weight_decay=wd)
    run_against("lion", LionFormula, kw, ["exp_avg"], shape, seed, steps)


@SETTINGS
@given(lr=lr, momentum=st.floats(0.0, 0.99), wd=small, nesterov=st.booleans(), ns_steps=st.integers(0, 7),
       eps=st.sampled_from([1e-7, 1e-3]), shape=st.tuples(st.integers(1, 9), st.integers(1, 13)), seed=seed,
       steps=steps, adjust_lr_fn=st.sampled_from([None, "original", "match_rms_adamw"]))
def test_muon(lr, momentum, wd, nesterov, ns_steps, eps, shape, seed, steps, adjust_lr_fn):
    """Newton-Schulz runs in bfloat16 in both (the same operations on the same bfloat16 matrix), the rest in
    float64."""
    kw = dict(lr=lr, momentum=momentum, weight_decay=wd, nesterov=nesterov, ns_steps=ns_steps, eps=eps,
              ns_coefficients=(3.4445, -4.775, 2.0315), adjust_lr_fn=adjust_lr_fn)
    run_against("muon", torch.optim.Muon, kw, ["momentum_buffer"], shape, seed, steps)


@SETTINGS
@given(lr=lr, b1=unit, b2=unit, eps=eps, wd=small, shape=shape, seed=seed, steps=steps)
def test_lamb(lr, b1, b2, eps, wd, shape, seed, steps):
    kw = dict(lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    run_against("lamb", LambFormula, kw, ["exp_avg", "exp_avg_sq"], shape, seed, steps)


@SETTINGS
@given(lr=lr, decay=st.floats(-1.0, 0.0), eps1=st.sampled_from([None, 1e-30, 1e-3, 30.0]), eps2=st.sampled_from([0.0, 1e-3]),
       d=st.floats(1.0, 3.0), wd=small, maximize=st.booleans(),
       shape=st.one_of(shape, st.tuples(st.integers(1, 13))), seed=seed, steps=steps)
def test_adafactor(lr, decay, eps1, eps2, d, wd, maximize, shape, seed, steps):
    """Matrices factored (row_var [rows], col_var [cols] against torch's [rows, 1] and [1, cols]), vectors whole
    (row_var against torch's variance); eps1 None is float64's epsilon in both, 30 one that clamps the
    factored estimate's divisor (the gradients' squares here are about 0.01 to 100)."""
    kw = dict(lr=lr, beta2_decay=decay, eps=(eps1, eps2), d=d, weight_decay=wd, maximize=maximize)

    def states(opt, theirs, state):
        torch_state = opt.state[theirs]
        pairs = [("row_var", "row_var"), ("col_var", "col_var")] if len(shape) == 2 else [("row_var", "variance")]
        for ours, name in pairs:
            err = rel_err(state[ours], torch_state[name].reshape(-1))
            assert err <= REL_TOL, f"state {ours} relative error {err:.3e}"

    run_against("adafactor", torch.optim.Adafactor, kw, [], shape, seed, steps, check_states=states)


def test_every_builtin_has_a_parity_test():
    tested = {name[len("test_"):] for name in globals() if name.startswith("test_")}
    assert set(forge_dsl.builtin_names()) <= tested


def test_keywords_match_torch():
    """Every keyword and default of the torch counterpart, except implementation switches."""
    import inspect

    switches = {"self", "params", "foreach", "fused", "capturable", "differentiable"}
    for name, cls in [("adamw", torch.optim.AdamW), ("nadam", torch.optim.NAdam), ("radam", torch.optim.RAdam),
                      ("rmsprop", torch.optim.RMSprop), ("adagrad", torch.optim.Adagrad), ("sgd_momentum", torch.optim.SGD),
                      ("adafactor", torch.optim.Adafactor)]:
        ours = forge_dsl.load_spec(name).keyword_defaults()
        theirs = {k: v.default for k, v in inspect.signature(cls.__init__).parameters.items() if k not in switches}
        assert set(ours) == set(theirs), (name, set(ours) ^ set(theirs))
        for k, v in theirs.items():
            if name == "sgd_momentum" and k == "momentum":
                assert ours[k] is None  # required here; torch's default 0 is the `sgd` spec
                continue
            assert ours[k] == v, (name, k, ours[k], v)
    sgd = forge_dsl.load_spec("sgd").keyword_defaults()
    assert sgd == {"lr": 1e-3, "weight_decay": 0.0, "maximize": False}
