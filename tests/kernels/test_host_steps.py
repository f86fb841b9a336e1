"""A step's host program runs once for all the layers that share its keywords, step and scalar state
(`steps._kernel_host`): the same values as running it per layer, never another step's or keywords' values."""

from __future__ import annotations

import pytest
import torch

import forge_dsl
from forge_dsl.kernels import steps


@pytest.fixture(autouse=True)
def _empty_memo(monkeypatch):
    monkeypatch.setattr(steps, "_HOST_STEPS", {})


def _counting_host():
    calls = []

    def host(hypers, step, scalars):
        calls.append((step, dict(scalars)))
        return (hypers["lr"] / step + scalars.get("s", 0.0), 1), {"s": scalars.get("s", 0.0) + 1}

    return host, calls


def test_layers_of_one_step_share_one_run_of_the_host_program():
    host, calls = _counting_host()
    rounded = steps._kernel_host(host)
    hypers = {"lr": 0.1}
    first = rounded(hypers, 3, {})
    for _ in range(5):
        assert rounded(hypers, 3, {}) == first
    assert len(calls) == 1
    assert first[0] == (pytest.approx(0.1 / 3), 1) and type(first[0][1]) is int


def test_another_step_keywords_object_or_scalar_state_runs_it_again():
    host, calls = _counting_host()
    rounded = steps._kernel_host(host)
    hypers = {"lr": 0.1}
    rounded(hypers, 3, {"s": 0.0})
    rounded(hypers, 4, {"s": 0.0})  # another step
    rounded({"lr": 0.1}, 3, {"s": 0.0})  # equal keywords, another object: not trusted to be the same
    rounded(hypers, 3, {"s": -0.0})  # a scalar state of the other zero's sign
    rounded(hypers, 3, {"s": 2.0})
    assert len(calls) == 5
    assert rounded(hypers, 3, {"s": -0.0})[1] == {"s": 1.0} and len(calls) == 5


def test_a_model_step_through_the_shared_host_values_equals_the_reference():
    """Two layers of one param group stepped by the element-wise kernel share the host values of each step: both
    still match the float64 reference at every step."""
    gen = torch.Generator().manual_seed(4)
    params = [torch.randn(3, 70, generator=gen) for _ in range(2)]
    ref = [p.double() for p in params]
    states = [forge_dsl.init_state("adamw", p, layout="fp32") for p in params]
    ref_states = [forge_dsl.init_state("adamw", p) for p in ref]
    for step in range(1, 4):
        for p, r, st, rst in zip(params, ref, states, ref_states):
            g = torch.randn(3, 70, generator=gen)
            forge_dsl.kernels.step("adamw", p, g, st, step=step, rounding="nearest", lr=1e-2, weight_decay=0.1)
            forge_dsl.reference_step("adamw", r, g.double(), rst, step=step, lr=1e-2, weight_decay=0.1)
    for p, r in zip(params, ref):
        assert (p.double() - r).abs().max() <= 1e-5 * r.abs().max()


def test_keywords_resolved_once_per_value_objects_and_again_for_new_or_mutable_ones(monkeypatch):
    """`steps.resolved_hypers` remembers the resolution of the value objects a param group hands every layer (no
    key built again), resolves a new value object again, and never trusts a list (mutable in place)."""
    monkeypatch.setattr(steps, "_BY_IDENTITY", {})
    monkeypatch.setattr(steps, "_RESOLVED", {})
    spec = forge_dsl.load_spec("adamw")
    keys = []
    real_key = steps._hypers_key
    monkeypatch.setattr(steps, "_hypers_key", lambda h: (keys.append(1), real_key(h))[1])
    group = {"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 0.0}
    first = steps.resolved_hypers(spec, dict(group))
    for _ in range(4):  # every layer of the step: a new dict of the same value objects
        assert steps.resolved_hypers(spec, dict(group)) is first
    assert len(keys) == 1
    group["lr"] = 2e-3  # a scheduler's new value
    assert steps.resolved_hypers(spec, dict(group)).hypers["lr"] == 2e-3 and len(keys) == 2
    group["weight_decay"] = -0.0  # equal to 0.0, another sign: another resolution
    assert steps.resolved_hypers(spec, dict(group)).hypers["weight_decay"] == 0.0 and len(keys) == 3
    betas = [0.9, 0.99]
    assert steps.resolved_hypers(spec, {"betas": betas}).hypers["beta2"] == 0.99
    betas[1] = 0.95  # the same list object, changed in place
    assert steps.resolved_hypers(spec, {"betas": betas}).hypers["beta2"] == 0.95
