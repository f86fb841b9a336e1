"""The kernels' entry points check the state dict they are given against the spec, before any write.

A state's layout is read from its dtype and shape (`layouts.layout_of`), so storage of the wrong kind would be
updated as if it were right: int8 codes cast to float32 (a cast, or dcp.load into an fp32 optimizer) as values,
a signed state's codes in uint8 with the unsigned map of nonneg states, a nonneg state's in int8 with the signed
one. `kernels.step`, the linear entry points and `foreach_step` refuse each with a ValueError that names the
state and what it must be (`checks.check_state`, the rule `layouts.quantized_layout` / `resolve_layout` make
states by), and leave the weight and every state as they were.
"""

from __future__ import annotations

import pytest
import torch

import forge_dsl
from forge_dsl import kernels
from forge_dsl.kernels.foreach import foreach_step
from forge_dsl.testing import default_device

DEVICE = default_device()
N, K, T = 8, 128, 16


def _cast(state, name):  # codes converted to float32, their scales still beside them
    return {**state, name: state[name].float()}


def _retyped(state, name, dtype):  # the same bytes read as the other 8-bit type
    return {**state, name: state[name].view(dtype)}


def _without(state, key):
    return {k: v for k, v in state.items() if k != key}


# (case id, the layout the state was made in, how it is spoiled, the message)
BAD = [
    ("int8-cast-to-fp32", "int8", lambda s: _cast(s, "exp_avg"),
     r"'exp_avg'\]? is torch.float32, but 'exp_avg.scale' \(block scales\) sits beside it"),
    ("int4-cast-to-fp32", "int4", lambda s: _cast(s, "exp_avg_sq"),
     r"'exp_avg_sq'\]? is torch.float32, but 'exp_avg_sq.scale' \(block scales\) sits beside it"),
    ("signed-given-uint8", "int8", lambda s: _retyped(s, "exp_avg", torch.uint8),
     r"'exp_avg'\]? holds uint8 codes \(the sqrt map of a nonneg state\), but adamw's 'exp_avg' is not declared "
     r"nonneg \(signed\): as int8 it is int8 codes"),
    ("nonneg-given-int8", "int8", lambda s: _retyped(s, "exp_avg_sq", torch.int8),
     r"'exp_avg_sq'\]? holds int8 codes, but adamw's 'exp_avg_sq' is declared nonneg: as int8 it is uint8 codes"),
    ("signed-given-uint4", "int4", lambda s: _retyped(s, "exp_avg", torch.uint8),
     r"'exp_avg'\]? holds uint8 bytes of two int4 codes each \(the no-zero map of a nonneg state\), but adamw's "
     r"'exp_avg' is not declared nonneg \(signed\): as int4 it is int8 bytes of two int4 codes each"),
    ("nonneg-given-int4", "int4", lambda s: _retyped(s, "exp_avg_sq", torch.int8),
     r"'exp_avg_sq'\]? holds int8 bytes of two int4 codes each, but adamw's 'exp_avg_sq' is declared nonneg"),
    ("no-scales", "int8", lambda s: _without(s, "exp_avg.scale"), r"'exp_avg'\]? needs 'exp_avg.scale'"),
    ("scales-of-another-shape", "int8", lambda s: {**s, "exp_avg.scale": s["exp_avg.scale"][:, :1].contiguous()},
     r"('exp_avg'\]? needs 'exp_avg.scale', a contiguous float32 or bfloat16 tensor of shape"  # step, linear
     r"|'exp_avg.scale'\] has shape \(8, 1\) but params\[1\] of shape \(8, 128\) needs) \(8, 2\)"),  # foreach
    ("state-of-another-shape", "fp32", lambda s: {**s, "exp_avg": s["exp_avg"][:, :64].contiguous()},
     r"'exp_avg'\]? has shape \(8, 64\)"),
    ("state-missing", "fp32", lambda s: _without(s, "exp_avg_sq"), r"has no 'exp_avg_sq', which adamw needs"),
]


def _problem(layout, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=gen).to(DEVICE)
    state = forge_dsl.init_state("adamw", w, layout=layout)
    # a stepped state (codes and scales that are not all equal), so a refused write would show
    kernels.step("adamw", w, torch.randn(N, K, generator=gen).to(DEVICE), state, step=1, lr=1e-2)
    return w, state


def _snapshot(*tensors):
    return [t.clone() for t in tensors]


def _unchanged(before, after):
    return all(torch.equal(a.view(torch.uint8) if a.dtype == torch.bool else a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("entry", ["step", "linear_step", "fused_linear_step", "slab_linear_step"])
@pytest.mark.parametrize("case, layout, spoil, message", BAD, ids=[b[0] for b in BAD])
def test_a_state_that_is_not_what_the_spec_needs_is_refused_before_any_write(entry, case, layout, spoil, message):
    w, state = _problem(layout)
    bad = spoil(state)
    gen = torch.Generator().manual_seed(1)
    before = _snapshot(w, *bad.values())
    with pytest.raises(ValueError, match=message):
        if entry == "step":
            kernels.step("adamw", w, torch.randn(N, K, generator=gen).to(DEVICE), bad, step=2, lr=1e-2)
        else:
            x = torch.randn(T, K, generator=gen).to(DEVICE)
            dy = torch.randn(T, N, generator=gen).to(DEVICE)
            getattr(kernels, entry)("adamw", x, dy, w, bad, step=2, lr=1e-2)
    assert _unchanged(before, [w, *bad.values()])


@pytest.mark.parametrize("case, layout, spoil, message", BAD, ids=[b[0] for b in BAD])
def test_foreach_names_the_parameter_whose_state_is_wrong(case, layout, spoil, message):
    gen = torch.Generator().manual_seed(2)
    params = [torch.randn(N, K, generator=gen).to(DEVICE) for _ in range(2)]
    states = [forge_dsl.init_state("adamw", p, layout=layout) for p in params]
    grads = [torch.randn(N, K, generator=gen).to(DEVICE) for _ in params]
    foreach_step("adamw", params, grads, states, step=1, lr=1e-2)
    states[1] = spoil(states[1])
    before = _snapshot(*params, *(t for s in states for t in s.values()))
    with pytest.raises(ValueError, match=message) as info:
        foreach_step("adamw", params, grads, states, step=2, lr=1e-2)
    assert "states[1]" in str(info.value)
    assert _unchanged(before, [*params, *(t for s in states for t in s.values())])


def test_the_right_states_still_step():
    """Every layout init_state makes passes (nonneg states in uint8, signed in int8), one parameter or many."""
    for layout in ("fp32", "bf16", "int8", "int4"):
        w, state = _problem(layout)
        kernels.step("adamw", w, torch.randn(N, K, device=DEVICE), state, step=2, lr=1e-2)
        params = [w, w.clone()]
        foreach_step("adamw", params, [torch.randn(N, K, device=DEVICE) for _ in params],
                     [state, {k: v.clone() for k, v in state.items()}], step=3, lr=1e-2)
