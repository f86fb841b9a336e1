"""Bad arguments get a torch-style TypeError / ValueError that names them, before anything changes.

The hyperparameters' values (`forge_dsl.spec.keywords.resolve_hypers`), the step number and the rounding seed
(`config.check_step`, `config.check_seed`) of every kernel entry point and of `reference_step`, meta tensors,
`foreach_step`'s states, and layers with no rows or no columns (which are no error: nothing to update).
"""

from __future__ import annotations

import math

import pytest
import torch

import forge_dsl
from forge_dsl import ForgeOptimizer, init_state, kernels
from forge_dsl.kernels.foreach import foreach_step

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HUGE = 10**400  # an int no float holds


def linear_problem(N=8, K=64, layout="fp32", spec="adamw"):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(N, K, generator=gen).to(DEVICE, torch.bfloat16)
    x = torch.randn(2, 3, K, generator=gen).to(DEVICE, torch.bfloat16)
    dy = torch.randn(2, 3, N, generator=gen).to(DEVICE, torch.bfloat16)
    return x, dy, w, init_state(spec, w, layout=layout)


def entry_points():
    """name -> call(step=..., seed=..., **hypers) on a fresh problem: every public way to run a step."""
    def fused(**kw):
        x, dy, w, st = linear_problem()
        kernels.fused_linear_step("adamw", x, dy, w, st, **kw)

    def slab(**kw):
        x, dy, w, st = linear_problem()
        kernels.slab_linear_step("adamw", x, dy, w, st, **kw)

    def auto(**kw):
        x, dy, w, st = linear_problem()
        kernels.linear_step("adamw", x, dy, w, st, **kw)

    def elementwise(**kw):
        _, _, w, st = linear_problem()
        kernels.step("adamw", w, torch.randn_like(w), st, **kw)

    def reference(**kw):
        p = torch.randn(4, 5, dtype=torch.float64)
        kw.pop("seed", None)
        forge_dsl.reference_step("adamw", p, torch.randn_like(p), init_state("adamw", p), **kw)

    return {"fused": fused, "slab": slab, "linear_step": auto, "step": elementwise, "reference_step": reference}


ENTRY_POINTS = entry_points()


# ----------------------------------------------------------------------------
# Hyperparameter values
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("kw, message", [
    ({"lr": HUGE}, r"Invalid lr: an integer of 401 digits \(1000000000.*\) does not fit a float"),
    ({"betas": (HUGE, 0.9)}, r"Invalid betas\[0\] \(beta1\): an integer of 401 digits"),
    ({"weight_decay": -HUGE}, r"Invalid weight_decay: an integer of 401 digits"),
    ({"lr": torch.empty((), device="meta")}, r"adamw: lr must be a number, got a meta tensor"),
    ({"amsgrad": torch.empty((), dtype=torch.bool, device="meta")},
     r"adamw: amsgrad must be True or False, got a meta tensor"),
], ids=["huge-lr", "huge-beta1", "huge-negative", "meta-lr", "meta-flag"])
@pytest.mark.parametrize("where", ["step", "reference_step", "init_state", "ForgeOptimizer"])
def test_hyperparameter_values_are_named(kw, message, where):
    if where in ENTRY_POINTS:
        call = lambda: ENTRY_POINTS[where](step=1, **kw)  # noqa: E731
    elif where == "init_state":
        call = lambda: init_state("adamw", torch.zeros(3), **kw)  # noqa: E731
    else:
        call = lambda: ForgeOptimizer(torch.nn.Linear(64, 8).to(DEVICE), "adamw", **kw)  # noqa: E731
    with pytest.raises(ValueError, match=message):
        call()


# ----------------------------------------------------------------------------
# step and seed
# ----------------------------------------------------------------------------


BAD_STEPS = [
    (math.inf, ValueError, r"step must be a positive integer \(1 for the first step\), got inf"),
    (math.nan, ValueError, r"got nan"),
    (None, TypeError, r"step must be a positive integer \(1 for the first step\), got NoneType None"),
    ("3", TypeError, r"got str '3'"),
    (True, TypeError, r"got bool True"),
    (1.5, ValueError, r"got 1.5"),
    (0, ValueError, r"got 0"),
    (HUGE, ValueError, r"step must be at most 2\*\*53"),
    (torch.tensor([1, 2]), ValueError, r"step must be a positive integer, got a tensor of shape \(2,\)"),
]


@pytest.mark.parametrize("value, error, message", BAD_STEPS, ids=lambda v: None)
@pytest.mark.parametrize("where", list(ENTRY_POINTS))
def test_bad_step_is_named(where, value, error, message):
    with pytest.raises(error, match=message):
        ENTRY_POINTS[where](step=value)


BAD_SEEDS = [
    ("x", TypeError, r"seed must be an integer, got str 'x'"),
    (None, TypeError, r"seed must be an integer, got NoneType None"),
    (True, TypeError, r"got bool True"),
    (1.5, ValueError, r"seed must be an integer, got 1.5"),
    (math.inf, ValueError, r"got inf"),
]


@pytest.mark.parametrize("value, error, message", BAD_SEEDS, ids=lambda v: None)
@pytest.mark.parametrize("where", ["fused", "slab", "linear_step", "step"])
def test_bad_seed_is_named(where, value, error, message):
    with pytest.raises(error, match=message):
        ENTRY_POINTS[where](step=1, seed=value)


def test_refused_step_changes_nothing():
    x, dy, w, st = linear_problem(spec="nadam")
    before = w.clone(), {k: v.clone() for k, v in st.items()}
    for kw in ({"step": math.inf}, {"step": 1, "seed": "x"}):
        with pytest.raises((TypeError, ValueError)):
            kernels.fused_linear_step("nadam", x, dy, w, st, **kw)
        assert torch.equal(w, before[0])
        assert all(torch.equal(st[k], v) for k, v in before[1].items())


def test_whole_numbers_of_other_types_are_the_same_seed_and_step():
    """3.0, a tensor holding 3 and 3 draw the same stochastic rounding (bf16 weights)."""
    results = []
    for value in (3, 3.0, torch.tensor(3)):
        _, _, w, st = linear_problem()
        g = torch.randn(w.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.bfloat16)
        kernels.step("adamw", w, g, st, step=value, seed=value, lr=1e-2)
        results.append(w)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


# ----------------------------------------------------------------------------
# Meta tensors
# ----------------------------------------------------------------------------


def test_meta_tensors_are_refused_by_the_kernels():
    w = torch.empty(8, 64, device="meta")
    st = init_state("adamw", w, layout="fp32")
    with pytest.raises(ValueError, match=r"param is a meta tensor, which has no data to update; materialize it first"):
        kernels.step("adamw", w, torch.empty_like(w), st, step=1)
    with pytest.raises(ValueError, match=r"x is a meta tensor"):
        kernels.fused_linear_step("adamw", torch.empty(3, 64, device="meta"), torch.empty(3, 8, device="meta"),
                                  w, st, step=1)


@pytest.mark.parametrize("layout", [None, "fp32", "bf16", "int8"])
def test_init_state_on_meta_plans_the_state(layout):
    """On a meta parameter `init_state` gives meta tensors of the state's dtypes and shapes (for planning memory,
    or a model built on the meta device): nothing to refuse, no data is read."""
    w = torch.empty(8, 96, device="meta")
    st = init_state("adamw", w, layout=layout)
    real = init_state("adamw", torch.zeros(8, 96), layout=layout)
    assert st.keys() == real.keys()
    for k in st:
        assert st[k].dtype == real[k].dtype and st[k].shape == real[k].shape, k
        assert st[k].is_meta == (real[k].dim() > 0 and k != "step"), k  # scalar states stay on the CPU


# ----------------------------------------------------------------------------
# foreach_step
# ----------------------------------------------------------------------------


def foreach_problem(layout="fp32", shapes=((8,), (8,))):
    params = [torch.randn(s, device=DEVICE) for s in shapes]
    return params, [torch.randn_like(p) for p in params], [init_state("adamw", p, layout=layout) for p in params]


def test_foreach_refuses_a_state_of_another_shape():
    params, grads, states = foreach_problem()
    states[1]["exp_avg"] = torch.zeros(2, 4, device=DEVICE)  # the same number of elements: it used to be accepted
    before = [p.clone() for p in params]
    with pytest.raises(ValueError, match=r"states\[1\]\['exp_avg'\] has shape \(2, 4\) but params\[1\] of shape "
                                         r"\(8,\) needs \(8,\); create it with forge_dsl.init_state"):
        foreach_step("adamw", params, grads, states, step=1)
    assert all(torch.equal(a, b) for a, b in zip(params, before))


def test_foreach_refuses_a_scale_of_another_shape():
    params, grads, states = foreach_problem("int8", ((2, 128), (2, 128)))
    states[0]["exp_avg.scale"] = states[0]["exp_avg.scale"].reshape(4, 1)
    with pytest.raises(ValueError, match=r"states\[0\]\['exp_avg.scale'\] has shape \(4, 1\) but params\[0\] of shape "
                                         r"\(2, 128\) needs \(2, 2\)"):
        foreach_step("adamw", params, grads, states, step=1)


def test_foreach_refuses_grads_and_states_on_another_device():
    params, grads, states = foreach_problem()
    states[1]["exp_avg_sq"] = torch.empty(8, device="meta")
    with pytest.raises(ValueError, match=r"states\[1\]\['exp_avg_sq'\] is on meta but params\[1\] is on"):
        foreach_step("adamw", params, grads, states, step=1)
    params, grads, states = foreach_problem()
    grads[0] = torch.empty(8, device="meta")
    with pytest.raises(ValueError, match=r"grads\[0\] is on meta but params\[0\] is on"):
        foreach_step("adamw", params, grads, states, step=1)
    grads[0] = torch.randn(3, device=DEVICE)
    with pytest.raises(ValueError, match=r"grads\[0\] has shape \(3,\) but params\[0\] has \(8,\)"):
        foreach_step("adamw", params, grads, states, step=1)


# ----------------------------------------------------------------------------
# Layers with no rows or no columns, and activations with no feature dim
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("N, K", [(0, 64), (8, 0)], ids=["no-outputs", "no-inputs"])
@pytest.mark.parametrize("path", ["fused", "slab", "auto"])
def test_zero_size_layer_is_a_step_with_nothing_to_update(N, K, path):
    x, dy, w, st = linear_problem(N, K, spec="nadam")
    kernels.linear_step("nadam", x, dy, w, st, path=path, step=1)
    assert w.shape == (N, K)
    assert st["mu_product"].item() != 1.0  # the scalar state still steps, as on any other layer


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
def test_model_with_a_layer_without_inputs_trains():
    torch.manual_seed(0)
    empty = torch.nn.Linear(0, 8).to(DEVICE)
    model = torch.nn.Linear(64, 8).to(DEVICE)
    opt = ForgeOptimizer(torch.nn.ModuleList([empty, model]), "adamw", lr=1e-2)
    bias, weight = empty.bias.detach().clone(), model.weight.detach().clone()
    x = torch.randn(2, 64, device=DEVICE)
    (model(x) + empty(x[:, :0])).pow(2).mean().backward()
    opt.step()
    assert not torch.equal(empty.bias, bias) and not torch.equal(model.weight, weight)


def test_activations_without_a_feature_dim_are_refused():
    _, _, w, st = linear_problem()
    with pytest.raises(ValueError, match=r"x \[\.\.\., K\] and dy \[\.\.\., N\] need a feature dim"):
        kernels.fused_linear_step("adamw", torch.tensor(1.0), torch.tensor(1.0), w, st, step=1)
