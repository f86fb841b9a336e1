"""`forge-test` (forge_dsl.testing): passes correct specs, fails wrong kernels and wrong references with a
reproducer that reruns the failure, and refuses bad command lines."""

from __future__ import annotations

import itertools
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import forge_dsl
from spec_lists import ELEMENT_WISE
from forge_dsl.compiler import codegen
from forge_dsl.spec.variants import combinations
from forge_dsl.spec.keywords import resolve_hypers
from forge_dsl.testing import (UPDATE_FLOOR, UPDATE_REL, UPDATE_ULPS, Case, K, N, RoundingMean, bf16_ulp,
                               check_reference, check_spec_kernels, covering_combos, draw_keywords, dw_error_bound,
                               main, run_case, update_bound, update_slack)
from forge_dsl.testing import cases
from forge_dsl.testing.problems import combos_for, default_combo
from forge_dsl.testing.sweep import keywords_for

# A user spec with a flag and two states: AdaBelief (Zhuang et al., 2020), decoupled or L2 weight decay.
ADABELIEF = """
optimizer adabelief "AdaBelief (Zhuang et al., 2020)"
hyper lr = 1e-3 in [0, inf)
hyper betas = (beta1 = 0.9, beta2 = 0.999) in [0, 1)
hyper eps = 1e-16 in [0, inf)
hyper weight_decay = 0 in [0, inf)
flag decoupled = true
state exp_avg = 0
state exp_avg_var = 0 nonneg
update {
    g = grad
    if decoupled {
        param = param * (1 - lr * weight_decay)
    } else {
        g = g + weight_decay * param
    }
    exp_avg = beta1 * exp_avg + (1 - beta1) * g
    exp_avg_var = beta2 * exp_avg_var + (1 - beta2) * (g - exp_avg) * (g - exp_avg) + eps
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    denom = sqrt(exp_avg_var / bias_correction2) + eps
    param = param - lr / bias_correction1 * exp_avg / denom
}
"""

# SGD with momentum whose weight decay skips the buffer: torch.optim.SGD puts it in (g = grad + wd·p first).
SGD_DECAY_OUTSIDE = """
optimizer my_sgd "SGD with momentum, decay outside the buffer"
hyper lr = 1e-3 in [0, inf)
hyper momentum = 0.9 in [0, 1)
hyper weight_decay = 0 in [0, inf)
state momentum_buffer = 0
update {
    momentum_buffer = momentum * momentum_buffer + grad
    param = param - lr * (momentum_buffer + weight_decay * param)
}
"""
SGD_AS_TORCH = SGD_DECAY_OUTSIDE.replace(
    "momentum_buffer = momentum * momentum_buffer + grad\n    param = param - lr * (momentum_buffer + weight_decay * param)",
    "momentum_buffer = momentum * momentum_buffer + grad + weight_decay * param\n    param = param - lr * momentum_buffer")


def write_spec(tmp_path, text: str, name: str, salt: str = "") -> str:
    """A spec file; `salt` (a comment) gives it its own source hash, so its compiled module is its own."""
    path = tmp_path / f"{name}.fopt"
    path.write_text(f"# {salt}\n{text}" if salt else text)
    return str(path)


def python_of(reproducer: str) -> str:
    (code,) = re.findall(r"```python\n(.*?)```", reproducer, flags=re.S)
    return code


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A compile cache of the test's own."""
    monkeypatch.setenv("FORGE_DSL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_user_spec_passes_quick(tmp_path, cache, capsys):
    path = write_spec(tmp_path, ADABELIEF, "adabelief", salt="passes")
    assert main([path, "--quick"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"spec\s+path\s+check\s+flags on\s+layout\s+weights\s+shape\s+worst error\s+bound\s+verdict", out)
    rows = [line for line in out.splitlines() if line.startswith("adabelief ")]
    paths = {line.split()[1] for line in rows}
    assert {"fused", "slab", "step"} <= paths
    assert all(line.split()[-1] == "ok" for line in rows) and len(rows) >= 20
    for layout in ("fp32", "int8", "mixed", "bf16"):
        assert any(line.split()[4] == layout for line in rows), layout
    assert "bf16/nearest" in out and "bf16/stochastic" in out and "1×70" in out and "33×1" in out
    assert any(line.split()[3] == "decoupled" for line in rows) and any(line.split()[3] == "-" for line in rows)
    assert "failed" in out and " 0 failed" in out and "first failure" not in out


def test_wrong_kernel_fails_with_a_reproducer_that_reruns_it(tmp_path, cache, capsys, monkeypatch):
    """sqrt spelled 1 % too large in the generated kernels (not in the reference): forge-test exits 1 and
    prints a reproducer; its Python reruns the failure; the same case on a correctly compiled spec passes."""
    real = codegen._elem_expr

    def wrong_sqrt(instr, bool_exports):
        text = real(instr, bool_exports)
        return f"({text}) * 1.01" if instr.op == "sqrt" else text

    monkeypatch.setattr(codegen, "_elem_expr", wrong_sqrt)
    path = write_spec(tmp_path, ADABELIEF, "adabelief", salt="wrong sqrt")
    assert main([path, "--quick"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"adabelief\s+fused\s+chain.*FAIL", out)
    assert "first failure: weight" in out and "rerun:" in out
    code = python_of(out)
    assert "Case(spec=" in code and "keywords={" in code and "seed=" in code
    scope: dict = {}
    exec(code, scope)
    assert not scope["result"].ok, scope["result"].describe()
    assert scope["result"].step == scope["case"].steps  # it reruns up to the failing step
    monkeypatch.undo()  # a correct compile of the same spec (another source hash: its own module)
    monkeypatch.setenv("FORGE_DSL_CACHE", str(cache))
    fixed = write_spec(tmp_path, ADABELIEF, "adabelief_fixed", salt="correct sqrt")
    assert run_case(scope["case"].replace(spec=fixed)).ok


# A spec without state: nothing but the weight can show a wrong update.
SIGN_DESCENT = """
optimizer sign_descent "sign descent, no state"
hyper lr = 1e-3 in [0, inf)
update {
    param = param - lr * sign(grad)
}
"""
HOST_KINDS = ("const", "hyper", "step", "scalar", "host")


def off_by(monkeypatch, factor: float) -> None:
    """Generated kernels' products of a host value and an element `factor` times too large (not the reference)."""
    real = codegen._elem_expr

    def wrong_mul(instr, bool_exports):
        text = real(instr, bool_exports)
        host = sum(a.kind in HOST_KINDS for a in instr.args)
        return f"({text}) * {factor!r}" if instr.op == "mul" and host == 1 else text

    monkeypatch.setattr(codegen, "_elem_expr", wrong_mul)


def test_update_a_tenth_of_a_percent_off_fails_a_state_free_spec(tmp_path, cache, monkeypatch):
    """lr · sign(grad) 0.1 % too large in the kernels: inside the weight's fp32 slack (2e-5 of |w|) and far
    below a bf16 ulp, but every path and both weight dtypes fail the update's check."""
    off_by(monkeypatch, 1.001)
    path = write_spec(tmp_path, SIGN_DESCENT, "sign_descent", salt="lr 0.1 % off")
    report = check_spec_kernels(path, quick=True)
    assert not report.ok
    failed = {(r.case.path, r.case.weights) for r in report.rows if not r.ok and r.where.startswith("weight update")}
    assert {(p, w) for p in ("fused", "slab", "step") for w in ("fp32", "bf16")} <= failed, report.table()
    big = [r for r in report.rows if tuple(r.case.shape) == (N, K)]
    assert big and not any(r.ok for r in big), report.table()
    monkeypatch.undo()
    monkeypatch.setenv("FORGE_DSL_CACHE", str(cache))
    fixed = write_spec(tmp_path, SIGN_DESCENT, "sign_descent_fixed", salt="correct")
    assert check_spec_kernels(fixed, quick=True).ok


def test_update_a_tenth_of_a_percent_off_fails_fp32_weights_of_every_builtin(tmp_path, cache, monkeypatch):
    """Each built-in compiled with its new weight w + 1.001 · (w' − w): one fp32 step on each path fails, from
    the first step, at the update; the weight's own bound (2e-5 · |w|) passes most of them."""
    real = codegen._variant_data

    def wrong_update(spec, index, low):
        data = real(spec, index, low)
        new_w, *rest = data["update_returns"]  # the new weight first, then the states
        return {**data, "update_returns": [f"b_param + (({new_w}) - b_param) * 1.001", *rest]}

    monkeypatch.setattr(codegen, "_variant_data", wrong_update)
    for name in ELEMENT_WISE:
        spec = forge_dsl.load_spec(name)
        path = write_spec(tmp_path, Path(spec.path).read_text(), name, salt="update 0.1 % off")
        kw = keywords_for(spec, default_combo(spec), seed=0)
        for p in ("fused", "slab", "step"):
            result = run_case(Case(spec=path, path=p, keywords=kw, steps=2, seed=1))
            assert not result.ok and result.step == 1 and result.where.startswith("weight update"), result.describe()


def test_rounding_mean_alone_fails_a_wrong_sqrt(tmp_path, cache, monkeypatch):
    """The 1 %-wrong sqrt of the first test, bf16 weights with stochastic rounding, every per-element check
    switched off: the mean rounding error along the update fails it; a correct compile passes."""
    real_elementwise = cases._elementwise
    monkeypatch.setattr(cases, "_elementwise", lambda worst, *args, **kw: real_elementwise(cases._Worst(), *args, **kw))
    kw = keywords_for(forge_dsl.load_spec(write_spec(tmp_path, ADABELIEF, "ab")), (("decoupled", True),), seed=0)
    correct = write_spec(tmp_path, ADABELIEF, "adabelief_correct", salt="correct sqrt, mean")
    case = Case(spec=correct, path="step", keywords=kw, layout="int8", weights="bf16", steps=4, seed=5)
    good = run_case(case)
    assert good.ok and good.where.startswith("weight update: mean") and 0 < good.error < good.bound / 2, good.describe()
    real_expr = codegen._elem_expr
    monkeypatch.setattr(codegen, "_elem_expr", lambda instr, b: f"({real_expr(instr, b)}) * 1.01"
                        if instr.op == "sqrt" else real_expr(instr, b))
    wrong = write_spec(tmp_path, ADABELIEF, "adabelief_wrong", salt="wrong sqrt, mean")
    for p in ("fused", "slab", "step"):
        bad = run_case(case.replace(spec=wrong, path=p))
        assert not bad.ok and "mean stochastic rounding" in bad.where and bad.error > 2 * bad.bound, bad.describe()


def test_rounding_mean_bound_holds_for_unbiased_rounding_and_catches_a_bias():
    """`RoundingMean` on stochastic rounding emulated in torch (16 random bits added, truncated), 20 seeds:
    within its bound; with the rounded values' update 1 % too large: beyond it for every seed."""
    def sr(v: torch.Tensor, gen) -> torch.Tensor:
        bits = v.float().view(torch.int32).to(torch.int64)
        bits = (bits + torch.randint(0, 65536, v.shape, generator=gen)) >> 16 << 16
        return bits.to(torch.int32).view(torch.float32).double()

    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        w0 = (torch.randn(100, 400, generator=gen) * 0.5).bfloat16().double()
        ref = w0 - 0.01 * torch.randn(100, 400, generator=gen, dtype=torch.float64).sign()
        slack = update_slack(w0, ref)
        right, biased = RoundingMean(), RoundingMean()
        right.add(w0, ref, sr(ref, gen), slack)
        biased.add(w0, ref, sr(w0 + (ref - w0) * 1.01, gen), slack)
        assert right.statistic <= right.bound and biased.statistic > 2 * biased.bound, seed
        assert right.n == w0.numel() and 0.015 <= right.bound < 0.017  # 3 / sqrt(40000), plus the slack's share


def test_dw_error_bound_holds_for_fp32_products():
    """fp32 dyᵀx (torch's GEMM) within `dw_error_bound` of the float64 product; a worst case, T·u against the
    typical sqrt(T)·u, but not loose beyond that: the largest error is above a thousandth of the bound."""
    gen = torch.Generator().manual_seed(0)
    dy, x = torch.randn(512, 64, generator=gen), torch.randn(512, 96, generator=gen)
    err = ((dy.T @ x).double() - dy.double().T @ x.double()).abs()
    bnd = dw_error_bound(dy, x)
    assert (err <= bnd).all() and (err / bnd).max() > 1e-3


def test_update_bound_counts_fp32_ulps_the_update_and_a_floor():
    w0 = torch.tensor([1.0, -0.75, 2.0**-20, 3.0], dtype=torch.float64)
    ref = w0 + torch.tensor([1e-2, 0.0, -1e-3, 2e-2], dtype=torch.float64)
    slack = update_slack(w0, ref)
    ulp = torch.tensor([2.0**-23, 2.0**-24, 2.0**-33, 2.0**-22], dtype=torch.float64)
    expected = UPDATE_ULPS * ulp + UPDATE_REL * (ref - w0).abs() + UPDATE_FLOOR * 2e-2
    assert torch.allclose(slack, expected, rtol=1e-12, atol=0)
    spread = torch.tensor([0.0, 1e-6, 0.0, 0.0], dtype=torch.float64)
    assert update_slack(w0, ref, spread)[1] == expected[1] + 1e-6
    nearest = update_bound(w0, ref, torch.bfloat16, "nearest")
    assert torch.allclose(nearest, 0.5 * bf16_ulp(ref.abs() + slack) + slack, rtol=1e-12, atol=0)
    stochastic = update_bound(w0, ref, torch.bfloat16, "stochastic")
    assert torch.allclose(stochastic, bf16_ulp(ref.abs() + slack) + slack, rtol=1e-12, atol=0)


def test_wrong_reference_fails_against_torch(tmp_path, capsys):
    path = write_spec(tmp_path, SGD_DECAY_OUTSIDE, "my_sgd")
    assert main([path, "--against", "torch.optim:SGD", "--reference-only"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"my_sgd\s+vs torch.optim:SGD\s+against.*FAIL", out)
    scope: dict = {}
    exec(python_of(out), scope)
    assert not scope["result"].ok and scope["case"].keywords["weight_decay"] > 0
    good = write_spec(tmp_path, SGD_AS_TORCH, "my_sgd_as_torch")
    assert main([good, "--against", "torch.optim:SGD", "--reference-only"]) == 0


def test_adamw_against_adam_fails_and_against_adamw_passes(capsys):
    """Adam's weight_decay is L2 in the gradient, AdamW's decoupled: every combination differs, from step 1."""
    assert main(["adamw", "--against", "torch.optim:Adam", "--reference-only"]) == 1
    out = capsys.readouterr().out
    assert len(re.findall(r"vs torch.optim:Adam\s+against.*FAIL", out)) == 4
    assert main(["adamw", "--against", "torch.optim:AdamW", "--reference-only"]) == 0
    assert len(re.findall(r"vs torch.optim:AdamW\s+against.*ok", capsys.readouterr().out)) == 4


def test_reference_api_every_builtin_against_torch():
    """check_reference over every flag combination, from the built-ins with a torch.optim twin."""
    twins = {"adamw": "AdamW", "nadam": "NAdam", "radam": "RAdam", "rmsprop": "RMSprop", "adagrad": "Adagrad",
             "sgd": "SGD", "sgd_momentum": "SGD"}
    for name, cls in twins.items():
        report = check_reference(name, f"torch.optim:{cls}", steps=6)
        assert report.ok, report.reproducer
        assert len(report.rows) == len(combinations(forge_dsl.load_spec(name)))
    lion = check_reference("lion", "references:LionFormula", steps=6)  # tests/helpers/references.py
    assert lion.ok and lion.first_failure is None and lion.reproducer is None


def test_a_class_that_refuses_the_keywords_fails(capsys):
    assert main(["lion", "--against", "torch.optim:SGD", "--reference-only"]) == 1  # SGD takes no betas
    assert "refused the spec's keywords" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["nosuchopt"], "no built-in optimizer named 'nosuchopt'"),
    (["missing.fopt"], "no spec file at 'missing.fopt'"),
    (["adamw", "--against", "torch.optim.AdamW"], "--against takes MODULE:CLASS"),
    (["adamw", "--against", "no_such_module_xyz:Adam"], "cannot import 'no_such_module_xyz'"),
    (["adamw", "--against", "torch.optim:Adamm"], "torch.optim has no 'Adamm'"),
    (["adamw", "--against", "math:pi"], "'pi' is not a class"),
    (["adamw", "--reference-only"], "give --against MODULE:CLASS"),
    (["adamw", "--steps", "0"], "--steps must be a positive integer"),
])
def test_usage_errors_exit_2(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_spec_error_is_its_message_exit_1(tmp_path, capsys):
    path = write_spec(tmp_path, "optimizer bad\nhyper lr = 1e-3\nupdate {\n    param = param - lr * sqr(grad)\n}\n", "bad")
    assert main([path, "--quick"]) == 1
    err = capsys.readouterr().err
    assert re.search(r"bad\.fopt:4:\d+: .*sqr", err) and "^" in err and "Traceback" not in err


def test_drawn_keywords_reach_every_combination_inside_the_ranges():
    """Every built-in and combination: the keywords resolve to that combination (derived flags through their
    hyperparameters, `require`s passed), each hyperparameter inside its range and away from its default where
    the combination allows it, weight decay non-zero."""
    for name in ELEMENT_WISE:
        spec = forge_dsl.load_spec(name)
        for combo in combinations(spec):
            kw = draw_keywords(spec, combo, random.Random(1))
            cfg = resolve_hypers(spec, kw)
            assert cfg.combo == combo, (name, combo)
            for h in spec.hypers:
                v = cfg.hypers[h.name]
                assert h.interval.contains(v)
                if h.name == "weight_decay":
                    assert v > 0, name
            moved = sum(cfg.hypers[h.name] != h.default for h in spec.hypers)
            off = dict(combo)
            pinned = (off.get("nesterov", False)  # dampening == 0
                      + (name == "rmsprop" and not off["has_momentum"]))  # momentum == 0
            assert moved >= len(spec.hypers) - pinned, (name, combo, kw)


def test_unreachable_combination_is_skipped_and_said(tmp_path):
    path = write_spec(tmp_path, "optimizer capped\nhyper lr = 1e-3 in [0, 0.5]\nflag big = lr > 1\n"
                      "update {\n    param = param - where(big, 0, lr) * grad\n}\n", "capped")
    spec = forge_dsl.load_spec(path)
    assert draw_keywords(spec, (("big", True),), random.Random(0)) is None
    report = check_reference(path, "torch.optim:SGD")
    skipped = [r for r in report.rows if "skipped" in r.note]
    assert len(skipped) == 1 and "big=true" in skipped[0].note and skipped[0].ok


def test_covering_combos_cover_every_pair():
    flags = "".join(f"flag f{i} = false\n" for i in range(5))
    scale = " * ".join(f"where(f{i}, 1, 2)" for i in range(5))
    text = f"optimizer many\nhyper lr = 1e-3 in [0, inf)\n{flags}update {{\n    param = param - lr * grad * {scale}\n}}\n"
    spec = forge_dsl.spec.parser.parse_spec(text, "many.fopt")
    spec = forge_dsl.spec.checker.check_spec(spec)
    chosen = covering_combos(spec)
    assert len(chosen) < 2**5 and chosen[0] == default_combo(spec) and all(v for _, v in chosen[1])
    for i, j in itertools.combinations(range(5), 2):
        for a, b in itertools.product((False, True), repeat=2):
            assert any(c[i][1] == a and c[j][1] == b for c in chosen), (i, j, a, b)


def test_drawn_learning_rate_moves_the_weight_by_a_few_percent():
    from forge_dsl.testing.sweep import UPDATE_BAND, _update_ratio
    from forge_dsl.testing.problems import make_problem

    w0 = make_problem(0, torch.float32, device=torch.device("cpu"))[0].double()
    for name in ELEMENT_WISE:  # every combination a quick run covers (sgd_momentum's nesterov: lr > 0)
        spec = forge_dsl.load_spec(name)
        for combo, seed in itertools.product(combos_for(spec, quick=True), (0, 3)):
            kw = keywords_for(spec, combo, seed=seed)
            ratio = _update_ratio(spec, kw, w0)
            assert UPDATE_BAND[0] / 3 <= ratio <= UPDATE_BAND[1] * 3, (name, combo, seed, ratio)


def test_case_source_round_trips():
    case = Case(spec="adamw", path="slab", keywords={"lr": 0.1 / 3, "betas": (0.9, 0.99), "amsgrad": True},
                layout={"exp_avg": "int8", "exp_avg_sq": "bf16"}, weights="bf16", rounding="nearest",
                shape=(33, 1), steps=3, seed=12345)
    from forge_dsl.testing import cases

    assert eval(case.source(), vars(cases)) == case


@pytest.mark.skipif(shutil.which("forge-test") is None, reason="forge-test is not installed (pip install -e .)")
def test_console_script():
    result = subprocess.run(["forge-test", "sgd", "--against", "torch.optim:SGD", "--reference-only"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "vs torch.optim:SGD" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lion"])
def test_full_sweep_of_a_builtin(name, capsys):
    """The default (non-quick) sweep: every combination, every layout × weights × path, awkward shapes."""
    assert main([name]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert {"halves", "split"} <= {line.split()[1] for line in out.splitlines() if line.startswith(name)}


@pytest.mark.slow
@pytest.mark.parametrize("name", ELEMENT_WISE)
def test_quick_passes_every_builtin(name):
    """The correct kernels of every built-in pass the quick run, the update's checks included."""
    report = check_spec_kernels(name, quick=True)
    assert report.ok, report.reproducer


@pytest.mark.gpu
def test_quick_on_the_gpu(capsys):
    """Compiled kernels (the interpreter accepts code the compiler rejects); on Hopper the warp-specialized path."""
    from forge_dsl.kernels import policy

    assert main(["adamw", "--quick", "--device", "cuda"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    if policy.hopper_with_gluon(torch.device("cuda")):
        assert re.search(r"adamw\s+ws\s+per-step", out)


EXACT_STATES = """\
optimizer sf_exact "schedule-free-like: a state from the weights and an exact accumulator"
hyper lr = 1e-2 in [0, inf)
hyper beta = 0.9 in [0, 1)
state z = param
state v = 0 nonneg
state e = 0 exact
update {
    v = v + (1 - beta) * (grad * grad - v)
    e = e + grad
    z = z - lr * grad / (sqrt(v) + 1e-8)
    param = param + (1 - beta) * (z - param) + 1e-3 * e
}
"""


def test_quick_passes_a_spec_whose_states_must_stay_exact(tmp_path):
    """A state from `param` and an `exact` one stay fp32 in every layout forge-test draws, the "mixed" one too
    (a layout dict that quantized them would be refused: `forge_dsl.api.state_layout`)."""
    path = tmp_path / "sf_exact.fopt"
    path.write_text(EXACT_STATES)
    report = check_spec_kernels(str(path), quick=True)
    assert report.ok, report.reproducer
    assert {row.case.layout_label() for row in report.rows} >= {"int8", "mixed", "fp32"}


# The gradient only copied into a state, and an output that simplifies to plain grad: reference_step raised
# KeyError: 'grad' on both, so forge-test crashed before comparing anything.
COPIED_GRAD = """
optimizer copied_grad "a step by last step's gradient"
hyper lr = 1e-2 in [0, inf)
state prev = 0
state same = 0
update {
    param = param - lr * prev
    prev = grad
    same = -(-grad) * 1
}
"""


def test_quick_passes_a_spec_that_only_copies_the_gradient(tmp_path, cache, capsys):
    path = write_spec(tmp_path, COPIED_GRAD, "copied_grad")
    assert main([path, "--quick"]) == 0
    out = capsys.readouterr().out
    assert " 0 failed" in out and "first failure" not in out
