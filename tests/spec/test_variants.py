"""Which flags get compiled variants of their own (`variants.runtime_flags`), and that a runtime flag's
two values, run by one compiled variant, each match the reference step.

A flag read only inside the update's expressions (`g = where(maximize, -grad, grad)`) is a host value
of the kernels, as torch.optim's `maximize` is a runtime branch; one used by an `if`, a state's
condition or a derived flag selects code, so it keeps a variant per value.
"""

from __future__ import annotations

import pytest
import torch

import forge_dsl
from forge_dsl.spec.phases import is_phased, plan
from forge_dsl import kernels
from forge_dsl.spec.variants import combinations, runtime_flags, variant_of, variants
from forge_dsl.compiler.loader import compiled_module
from forge_dsl.testing import rel_err

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

SPEC = """\
optimizer flags_{name}
hyper lr = 1e-2 in [0, inf)
hyper momentum = 0 in [0, 1)
flag maximize = false
flag centered = false
flag has_momentum = momentum > 0
state buf = 0 if has_momentum
state avg = 0 if centered
update {{
    g = where(maximize, -grad, grad)
    if centered {{
        avg = 0.5 * avg + 0.5 * g
        g = g - avg
    }}
    if has_momentum {{
        buf = momentum * buf + g
        g = buf
    }}
    param = param - lr * g
}}
"""


def load(tmp_path, name: str, text: str):
    path = tmp_path / f"flags_{name}.fopt"
    path.write_text(text.format(name=name))
    return forge_dsl.load_spec(str(path))


def test_only_flags_read_in_expressions_alone_are_runtime(tmp_path):
    spec = load(tmp_path, "plain", SPEC)
    assert runtime_flags(spec) == {"maximize"}  # centered is an if, has_momentum a derived flag
    assert len(combinations(spec)) == 8 and len(variants(spec)) == 4
    assert variant_of(spec, (("maximize", True), ("centered", False), ("has_momentum", True))) == (
        ("centered", False), ("has_momentum", True))
    # a flag in a state's condition, or in a derived flag, selects code
    in_state = load(tmp_path, "state", SPEC.replace("state avg = 0 if centered", "state avg = 0 if maximize")
                    .replace("if centered {{", "if maximize {{").replace("where(maximize,", "where(centered,"))
    assert runtime_flags(in_state) == {"centered"}
    in_derived = load(tmp_path, "derived", SPEC.replace("flag has_momentum = momentum > 0",
                                                        "flag has_momentum = momentum > 0 and not maximize"))
    assert runtime_flags(in_derived) == frozenset()


def test_a_spec_with_an_optional_hyperparameter_keeps_every_flag_compile_time(tmp_path):
    text = SPEC.replace("hyper momentum = 0 in [0, 1)", "hyper momentum = 0 in [0, 1)\nhyper t = none in [1, inf)\n"
                        "flag has_t = given(t)").replace("param = param - lr * g",
                                                         "param = param - lr * g * where(has_t, t, 1)")
    spec = load(tmp_path, "optional", text)
    assert runtime_flags(spec) == frozenset()


def test_generated_modules_have_one_variant_per_compile_time_combination():
    for name in forge_dsl.builtin_names():
        spec = forge_dsl.load_spec(name)
        for compiled in plan(spec).phases if is_phased(spec) else (spec,):  # a phased spec: a module per phase
            module = compiled_module(compiled)
            assert set(module.VARIANTS) == set(variants(compiled)), compiled.name
    assert len(compiled_module(forge_dsl.load_spec("adamw")).VARIANTS) == 2  # amsgrad; maximize at run time


@pytest.mark.parametrize("path", ["fused", "step"])
def test_both_values_of_a_runtime_flag_match_the_reference(tmp_path, path):
    """One weight and state, the runtime flag switching between steps: one compiled variant, its host value
    changing, every step against the float64 reference."""
    spec = load(tmp_path, "run", SPEC)
    gen = torch.Generator().manual_seed(4)
    kw = dict(lr=0.05, momentum=0.5, centered=True)
    w = torch.randn(40, 70, generator=gen).to(DEVICE)
    ref_w = w.double().cpu()
    state = forge_dsl.init_state(spec, w, layout="fp32", **kw)
    ref_state = forge_dsl.init_state(spec, ref_w, **kw)
    for step, maximize in enumerate((False, True, True, False, True, False), 1):
        x = torch.randn(16, 70, generator=gen)
        dy = torch.randn(16, 40, generator=gen) * 0.1
        dw = dy.double().T @ x.double()
        if path == "fused":
            kernels.fused_linear_step(spec, x.to(DEVICE), dy.to(DEVICE), w, state, step=step, maximize=maximize, **kw)
        else:
            kernels.step(spec, w, dw.float().to(DEVICE), state, step=step, maximize=maximize, **kw)
        forge_dsl.reference_step(spec, ref_w, dw, ref_state, step=step, maximize=maximize, **kw)
        assert rel_err(w, ref_w) <= 1e-5, step
        assert rel_err(state["avg"], ref_state["avg"]) <= 1e-5, step
        assert rel_err(state["buf"], ref_state["buf"]) <= 1e-5, step


def test_maximize_flips_the_update_like_torch():
    """adamw's maximize=True against torch.optim.AdamW(maximize=True), through the element-wise kernel."""
    gen = torch.Generator().manual_seed(5)
    p = torch.randn(8, 64, generator=gen)
    ref = p.clone().requires_grad_(True)
    opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, maximize=True)
    w = p.clone().to(DEVICE)
    state = forge_dsl.init_state("adamw", w, layout="fp32")
    for step in range(1, 4):
        g = torch.randn(8, 64, generator=gen)
        ref.grad = g.clone()
        opt.step()
        kernels.step("adamw", w, g.to(DEVICE), state, step=step, lr=1e-2, weight_decay=0.1, maximize=True)
    assert rel_err(w, ref.detach()) <= 1e-5


def test_step_config_host_inputs_follow_its_hypers_and_flags():
    """host_inputs is derived from hypers and flags, so a replaced config (init_state's initial_hypers)
    never carries a stale copy."""
    import dataclasses

    from forge_dsl.spec.keywords import resolve_hypers

    cfg = resolve_hypers(forge_dsl.load_spec("adamw"), {"lr": 0.5, "maximize": True})
    assert cfg.host_inputs["lr"] == 0.5 and cfg.host_inputs["maximize"] is True
    assert cfg.variant == (("amsgrad", False),)
    assert dataclasses.replace(cfg, hypers={**cfg.hypers, "lr": 0.25}).host_inputs["lr"] == 0.25
