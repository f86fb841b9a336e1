"""NaN, infinity, zeros' signs and `**`: the kernels and the reference step agree on every operation.

One semantics (docs/LANGUAGE.md, "Numbers"): IEEE / torch float64 results, NaN propagating (also
through `sign`, `min`, `max`, `clamp`), every constant and host value computed in float64 and
rounded once to the arithmetic's dtype (fp32 in the kernels; docs/LANGUAGE.md, section 6). Each
operation of the language is applied to a table of special inputs (NaN, +-inf, +-0, subnormal,
tiny, large, negative, integer and fractional values, every pair of them) by the element-wise
kernel on fp32 weights and state, and by `forge_dsl.reference_step` in float64; the float64 result
rounded to fp32 must be NaN where the kernel's is NaN, the same infinity, and otherwise within fp32
error. Then the reference's own bugs: outputs that alias inputs, unary
operations of a host number, constants beyond fp32's range, and built-in Lion on a NaN gradient.
Then host values as the kernels read them (rounded once to fp32, bit for bit against torch's fp32
arithmetic), outputs that are plain inputs, and a schedule-free AdamW whose nonneg proof needs
`1 - beta2 ** step > 0`.
"""

from __future__ import annotations

import math

import pytest
import torch

import forge_dsl
from forge_dsl import kernels

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on NaN and inf in the interpreter
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NAN, INF = math.nan, math.inf

# Special inputs; the table holds every ordered pair of them (x = grad, y = param), then random values.
SPECIAL = [NAN, INF, -INF, 0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 0.5, -0.5, 3.0, -3.0, 1e-40, -1e-40, 2e-38, 1e-6,
           1e30, -1e30, 3e38, 0.375, -0.25, -7.25, 89.0]
ROWS, COLS = 10, 64  # 640 elements: 576 pairs, then random ones

OPS = """
optimizer numerics_ops "every operation on special values"
hyper lr = 0.5 in [0, inf)
hyper h = 0.25

state s_add = 0
state s_sub = 0
state s_mul = 0
state s_div = 0
state s_div_host = 0
state s_host_div = 0
state s_neg = 0
state s_neg_recip = 0
state s_sqrt = 0
state s_rsqrt = 0
state s_abs = 0
state s_sign = 0
state s_exp = 0
state s_log = 0
state s_min = 0
state s_max = 0
state s_clamp = 0
state s_where = 0
state s_lt = 0
state s_le = 0
state s_gt = 0
state s_ge = 0
state s_eq = 0
state s_ne = 0
state s_and = 0
state s_or = 0
state s_not = 0
state s_pow = 0
state s_atan = 0
state s_atan2 = 0
state s_tanh = 0
state s_erf = 0
state s_log1p = 0
state s_expm1 = 0
state s_const = 0
state s_hyper = 0

update {
    a = grad
    b = param
    s_add = a + b
    s_sub = a - b
    s_mul = a * b
    s_div = a / b
    s_div_host = a / h
    s_host_div = h / a
    s_neg = -a
    s_neg_recip = 1 / -a
    s_sqrt = sqrt(a)
    s_rsqrt = rsqrt(a)
    s_abs = abs(a)
    s_sign = sign(a)
    s_exp = exp(a)
    s_log = log(a)
    s_min = min(a, b)
    s_max = max(a, b)
    s_clamp = clamp(a, b, 2)
    s_where = where(a > b, a, b)
    s_lt = where(a < b, 1, 0)
    s_le = where(a <= b, 1, 0)
    s_gt = where(a > b, 1, 0)
    s_ge = where(a >= b, 1, 0)
    s_eq = where(a == b, 1, 0)
    s_ne = where(a != b, 1, 0)
    s_and = where(a > 0 and b > 0, 1, 0)
    s_or = where(a > 0 or b > 0, 1, 0)
    s_not = where(not (a > b), 1, 0)
    s_pow = a ** b
    s_atan = atan(a)
    s_atan2 = atan2(a, b)
    s_tanh = tanh(a)
    s_erf = erf(a)
    s_log1p = log1p(a)
    s_expm1 = expm1(a)
    s_const = 2.5
    s_hyper = h
    param = param - lr * grad
}
"""

POWERS = """
optimizer numerics_pow "powers of negative, zero, infinite and NaN bases"
hyper p = 3
hyper q = -5
hyper r = 0.5
hyper base = 2

state e_0 = 0
state e_2 = 0
state e_3 = 0
state e_5 = 0
state e_m1 = 0
state e_m2 = 0
state e_m5 = 0
state e_32 = 0
state e_33 = 0
state e_m33 = 0
state e_half = 0
state e_mhalf = 0
state e_frac = 0
state e_big = 0
state e_inf = 0
state e_minf = 0
state e_p = 0
state e_q = 0
state e_r = 0
state e_base = 0
state e_neg_base = 0

update {
    e_0 = grad ** 0
    e_2 = grad ** 2
    e_3 = grad ** 3
    e_5 = grad ** 5
    e_m1 = grad ** -1
    e_m2 = grad ** -2
    e_m5 = grad ** -5
    e_32 = grad ** 32
    e_33 = grad ** 33
    e_m33 = grad ** -33
    e_half = grad ** 0.5
    e_mhalf = grad ** -0.5
    e_frac = grad ** 1.5
    e_big = grad ** 1000000
    e_inf = grad ** inf
    e_minf = grad ** -inf
    e_p = grad ** p
    e_q = grad ** q
    e_r = grad ** r
    e_base = base ** grad
    e_neg_base = (0 - 2) ** grad
    param = param * p
}
"""

HYPERS = {"numerics_ops": {"lr": 0.5, "h": 0.25}, "numerics_pow": {"p": 3.0, "q": -5.0, "r": 0.5, "base": 2.0}}
# Relative error allowed per element: fp32 rounding of each operation, a few ulp for the library
# functions; the general power exp2(y * log2|x|) loses |y * log2|x|| * 1.2e-7 (at most 1.5e-5).
REL_TOL = {"e_33": 2e-5, "e_m33": 2e-5, "e_big": 2e-5, "e_p": 2e-5, "e_q": 2e-5, "s_pow": 2e-5}
# Compiled for NVIDIA GPUs, tl.sqrt and tl.rsqrt are the approximate instructions, which flush a
# subnormal input to a zero of its sign (sqrt -> +-0, rsqrt -> +-inf); the interpreter and the
# reference do not (docs/LANGUAGE.md, "Numbers"). On CUDA those elements must be exactly that.
GPU_FLUSHES_SUBNORMALS = {"s_sqrt": 0.0, "s_rsqrt": INF, "e_half": 0.0, "e_mhalf": INF}
# min, max and clamp of -0.0 and +0.0 may return either zero (docs/LANGUAGE.md, "Numbers").
ANY_ZERO_SIGN = {"s_min", "s_max", "s_clamp"}
# Below this magnitude fp32 has no relative precision (subnormals), so errors are absolute.
ABS_TOL = 1e-37


def _write(tmp_path_factory, text: str) -> str:
    name = text.split()[1]
    path = tmp_path_factory.mktemp("specs") / f"{name}.fopt"
    path.write_text(text)
    return str(path)


@pytest.fixture(scope="module", autouse=True)
def _own_cache(tmp_path_factory):
    """Generated modules for these specs go to a cache of this module's own."""
    mp = pytest.MonkeyPatch()
    mp.setenv("FORGE_DSL_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield
    mp.undo()


def special_table(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad, param) [ROWS, COLS] fp32: every ordered pair of SPECIAL, then random values of both signs."""
    s = torch.tensor(SPECIAL, dtype=torch.float32)
    n = len(SPECIAL)
    x, y = s.repeat_interleave(n), s.repeat(n)
    gen = torch.Generator().manual_seed(seed)
    rest = ROWS * COLS - n * n
    rx = torch.randn(rest, generator=gen) * torch.exp2(torch.randint(-8, 9, (rest,), generator=gen).float())
    ry = torch.randn(rest, generator=gen) * 3
    ry[::2] = torch.round(ry[::2])  # integer exponents for negative bases
    return torch.cat([x, rx]).view(ROWS, COLS), torch.cat([y, ry]).view(ROWS, COLS)


def run_both(path: str, grad: torch.Tensor, param: torch.Tensor, step: int = 1):
    """(kernel's state and param in fp32, reference's in float64) after one step from the same inputs."""
    hypers = HYPERS[forge_dsl.load_spec(path).name]
    p32 = param.clone().to(DEVICE)
    st32 = forge_dsl.init_state(path, p32, layout="fp32", **hypers)
    kernels.step(path, p32, grad.to(DEVICE), st32, step=step, rounding="nearest", **hypers)
    p64 = param.double()
    st64 = forge_dsl.init_state(path, p64, **hypers)
    forge_dsl.reference_step(path, p64, grad.double(), st64, step=step, **hypers)
    return {"param": p32, **st32}, {"param": p64, **st64}


def mismatches(kern: torch.Tensor, ref64: torch.Tensor, rel_tol: float = 1e-5, zero_sign: bool = True) -> torch.Tensor:
    """Indices where the kernel's fp32 value and the float64 reference rounded to fp32 disagree
    (a zero's sign included, unless `zero_sign` is False)."""
    k = kern.detach().double().cpu().flatten()
    r = ref64.detach().float().double().cpu().flatten()  # what an exact fp32 store would hold
    nan_k, nan_r = torch.isnan(k), torch.isnan(r)
    inf = torch.isinf(k) | torch.isinf(r)
    bad = (nan_k != nan_r) | (inf & ~nan_k & ~nan_r & (k != r))
    finite = ~nan_k & ~nan_r & ~inf
    bad |= finite & ((k - r).abs() > rel_tol * r.abs() + ABS_TOL)
    if zero_sign:
        bad |= (k == 0) & (r == 0) & (torch.signbit(k) != torch.signbit(r))
    return torch.nonzero(bad).flatten()


def check_flushed(name: str, x: torch.Tensor, kern: torch.Tensor, ref: torch.Tensor):
    """On CUDA, where `name` flushes subnormal inputs: those elements hold the flushed value; the
    reference there is replaced by it so that every other element is still compared."""
    if DEVICE.type != "cuda" or name not in GPU_FLUSHES_SUBNORMALS:
        return ref
    sub = (x != 0) & (x.abs() < 2.0**-126)
    flushed = torch.copysign(torch.full_like(ref, GPU_FLUSHES_SUBNORMALS[name]), x.double())
    assert torch.equal(kern.cpu()[sub].double(), flushed[sub]), name
    return torch.where(sub, flushed, ref)


def describe(idx, grad, param, kern, ref64) -> str:
    g, p = grad.flatten(), param.flatten()
    k, r = kern.detach().cpu().flatten(), ref64.detach().cpu().flatten()
    return "; ".join(f"grad={g[i].item()!r} param={p[i].item()!r}: kernel {k[i].item()!r}, reference "
                     f"{r[i].item()!r}" for i in idx[:6].tolist())


@pytest.fixture(scope="module")
def ops_run(tmp_path_factory):
    grad, param = special_table()
    return (grad, param) + run_both(_write(tmp_path_factory, OPS), grad, param)


@pytest.fixture(scope="module")
def pow_run(tmp_path_factory):
    grad, param = special_table(1)
    return (grad, param) + run_both(_write(tmp_path_factory, POWERS), grad, param)


OP_NAMES = ["param"] + [line.split()[1] for line in OPS.splitlines() if line.startswith("state ")]
POW_NAMES = ["param"] + [line.split()[1] for line in POWERS.splitlines() if line.startswith("state ")]


@pytest.mark.parametrize("name", OP_NAMES)
def test_operation_on_special_values(ops_run, name):
    grad, param, kern, ref = ops_run
    ref = {**ref, name: check_flushed(name, grad, kern[name], ref[name])}
    bad = mismatches(kern[name], ref[name], REL_TOL.get(name, 1e-5), zero_sign=name not in ANY_ZERO_SIGN)
    assert len(bad) == 0, f"{name}: {len(bad)} elements differ: " + describe(bad, grad, param, kern[name], ref[name])


@pytest.mark.parametrize("name", POW_NAMES)
def test_power_on_special_values(pow_run, name):
    grad, param, kern, ref = pow_run
    ref = {**ref, name: check_flushed(name, grad, kern[name], ref[name])}
    bad = mismatches(kern[name], ref[name], REL_TOL.get(name, 1e-5))
    assert len(bad) == 0, f"{name}: {len(bad)} elements differ: " + describe(bad, grad, grad, kern[name], ref[name])


def test_reference_follows_torch_float64(ops_run, pow_run):
    """The reference's semantics is torch's in float64 (sign aside: it keeps NaN, torch.sign gives 0)."""
    grad, param, _, ref = ops_run
    x, y = grad.double(), param.double()
    expected = {"s_pow": x**y, "s_atan2": torch.atan2(x, y), "s_min": torch.minimum(x, y),
                "s_sign": torch.where(torch.isnan(x), x, torch.sign(x)), "s_log1p": torch.log1p(x),
                "s_div": x / y, "s_const": torch.full_like(x, 2.5)}
    for name, want in expected.items():
        assert torch.allclose(ref[name], want, rtol=1e-15, atol=0, equal_nan=True), name
    grad, _, _, ref = pow_run
    x = grad.double()
    for name, e in (("e_5", 5.0), ("e_m5", -5.0), ("e_0", 0.0), ("e_inf", INF), ("e_frac", 1.5), ("e_p", 3.0)):
        assert torch.allclose(ref[name], torch.pow(x, e), rtol=1e-15, atol=0, equal_nan=True), name


def test_negative_bases_are_finite_with_integer_exponents(pow_run):
    """The bug: `grad ** 5`, `grad ** -5`, `grad ** p` were exp2(e * log2(grad)), NaN for grad < 0."""
    grad, _, kern, _ = pow_run
    neg = (grad < 0) & torch.isfinite(grad) & (grad.abs() > 1e-3) & (grad.abs() < 1e3)
    assert neg.sum() > 20
    for name in ("e_3", "e_5", "e_m5", "e_33", "e_m33", "e_p", "e_q"):
        v = kern[name].cpu()[neg]
        assert not v.isnan().any() and torch.signbit(v).all(), name  # -inf or -0.0 where |grad| ** 33 over/underflows
    assert torch.isnan(kern["e_half"].cpu()[neg]).all() and torch.isnan(kern["e_r"].cpu()[neg]).all()
    assert (kern["e_0"].cpu() == 1).all(), "x ** 0 is 1 for every x, inf and NaN included"


# ----------------------------------------------------------------------------
# The reference's own bugs
# ----------------------------------------------------------------------------

ALIASING = """
optimizer aliasing "MADGRAD-style: a state that keeps the first step's weights, a state of last step's v"
hyper lr = 1e-2 in [0, inf)
hyper momentum = 0.9 in [0, 1)

state x0 = 0
state v = 0
state v_prev = 0
state last_grad = 0

update {
    x0 = where(step == 1, param, x0)
    v_prev = where(step > 1, v, 0)
    v = momentum * v + grad
    last_grad = grad
    param = param - lr * (v + v_prev) - 0.1 * (param - x0)
}
"""


def _torch_aliasing_loop(p: torch.Tensor, grads: list[torch.Tensor], lr=1e-2, momentum=0.9):
    """The ALIASING spec, written out in torch."""
    x0 = torch.zeros_like(p)
    v = torch.zeros_like(p)
    v_prev = torch.zeros_like(p)
    for step, g in enumerate(grads, start=1):
        x0 = p.clone() if step == 1 else x0
        v_prev = v.clone() if step > 1 else torch.zeros_like(p)
        v = momentum * v + g
        p = p - lr * (v + v_prev) - 0.1 * (p - x0)
    return p, {"x0": x0, "v": v, "v_prev": v_prev, "last_grad": grads[-1]}


def test_outputs_never_alias_inputs(tmp_path):
    """`x0 = where(step == 1, param, x0)` must keep the weights from before the step, and
    `v_prev = where(step > 1, v, 0)` last step's v, in the reference and in the kernel."""
    path = tmp_path / "aliasing.fopt"
    path.write_text(ALIASING)
    gen = torch.Generator().manual_seed(3)
    p0 = torch.randn(8, 64, generator=gen, dtype=torch.float64)
    grads = [torch.randn(8, 64, generator=gen, dtype=torch.float64) for _ in range(4)]
    want_p, want_state = _torch_aliasing_loop(p0.clone(), grads)

    p64 = p0.clone()
    st64 = forge_dsl.init_state(str(path), p64)
    p32 = p0.float().to(DEVICE)
    st32 = forge_dsl.init_state(str(path), p32, layout="fp32")
    for step, g in enumerate(grads, start=1):
        forge_dsl.reference_step(str(path), p64, g, st64, step=step)
        kernels.step(str(path), p32, g.float().to(DEVICE), st32, step=step, rounding="nearest")
    assert torch.allclose(p64, want_p, rtol=1e-12, atol=0)
    for name, want in want_state.items():
        assert torch.allclose(st64[name], want, rtol=1e-12, atol=0), name
        assert (st32[name].double().cpu() - want).norm() <= 1e-5 * want.norm(), name
    assert (p32.double().cpu() - want_p).norm() <= 1e-5 * want_p.norm()


def test_grad_sharing_storage_with_param(tmp_path):
    """grad *is* param (or a view of it): every output reads the values from before the step."""
    path = tmp_path / "aliasing.fopt"
    path.write_text(ALIASING)
    p = torch.randn(8, 64, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    before = p.clone()
    state = forge_dsl.init_state(str(path), p)
    forge_dsl.reference_step(str(path), p, p.view(8, 64), state, step=1)
    want_p, want_state = _torch_aliasing_loop(before.clone(), [before])
    assert torch.equal(state["last_grad"], before)
    assert torch.allclose(p, want_p, rtol=1e-12, atol=0)
    assert torch.allclose(state["v"], want_state["v"], rtol=1e-12, atol=0)


HOST_NUMBERS = """
optimizer host_numbers "unary operations of a host number chosen by where()"
hyper lr = 1e-2 in [0, inf)

state u_abs = 0
state u_sqrt = 0
state u_rsqrt = 0
state u_exp = 0
state u_log = 0
state u_sign = 0
state u_atan = 0
state u_tanh = 0
state u_neg = 0

update {
    u_abs = abs(where(step == 1, -3, grad))
    u_sqrt = sqrt(where(step == 1, 4, grad))
    u_rsqrt = rsqrt(where(step == 1, 4, grad))
    u_exp = exp(where(step == 1, 0, grad))
    u_log = log(where(step == 1, 1, grad))
    u_sign = sign(where(step == 1, -2, grad))
    u_atan = atan(where(step == 1, 1, grad))
    u_tanh = tanh(where(step == 1, 0, grad))
    u_neg = -where(step == 1, 5, grad)
    param = param - lr * grad
}
"""


def test_unary_operations_of_host_numbers(tmp_path):
    path = tmp_path / "host_numbers.fopt"
    path.write_text(HOST_NUMBERS)
    gen = torch.Generator().manual_seed(5)
    g = (torch.rand(8, 64, generator=gen) + 0.5).double()  # fp32 values: the kernel reads the same inputs
    step1 = {"u_abs": 3.0, "u_sqrt": 2.0, "u_rsqrt": 0.5, "u_exp": 1.0, "u_log": 0.0, "u_sign": -1.0,
             "u_atan": math.pi / 4, "u_tanh": 0.0, "u_neg": -5.0}
    step2 = {"u_abs": g.abs(), "u_sqrt": g.sqrt(), "u_rsqrt": g.rsqrt(), "u_exp": g.exp(), "u_log": g.log(),
             "u_sign": g.sign(), "u_atan": g.atan(), "u_tanh": g.tanh(), "u_neg": -g}
    p64 = torch.randn(8, 64, generator=gen, dtype=torch.float64)
    st64 = forge_dsl.init_state(str(path), p64)
    p32 = p64.float().to(DEVICE)
    st32 = forge_dsl.init_state(str(path), p32, layout="fp32")
    for step, want in ((1, step1), (2, step2)):
        forge_dsl.reference_step(str(path), p64, g, st64, step=step)
        kernels.step(str(path), p32, g.float().to(DEVICE), st32, step=step, rounding="nearest")
        for name, w in want.items():
            w = torch.as_tensor(w, dtype=torch.float64).expand(8, 64)
            assert torch.allclose(st64[name], w, rtol=1e-12, atol=1e-15), (step, name)
            assert len(mismatches(st32[name], w)) == 0, (step, name)


BEYOND_FP32 = """
optimizer beyond_fp32 "constants outside fp32's range"
hyper lr = 1e-2 in [0, inf)

state b_min = 0
state b_where = 0
state b_mul = 0
state b_clamp = 0
state b_const = 0
state b_tiny = 0
state b_subnormal = 0

update {
    b_min = min(grad, 1e300)
    b_where = where(grad > 0, 1e300, -1e300)
    b_mul = grad * 1e300
    b_clamp = clamp(grad, -1e300, 1e-300)
    b_const = 1e300
    b_tiny = grad * 1e-300
    b_subnormal = where(grad > 0, 1e-40, grad)
    param = param - lr * grad
}
"""


def test_constants_beyond_fp32_round_like_the_kernel(tmp_path):
    """On fp32 parameters a constant is rounded to fp32 (1e300 -> inf, 1e-300 -> 0), as the kernel's fp32
    arithmetic does; the reference raised on them."""
    path = tmp_path / "beyond_fp32.fopt"
    path.write_text(BEYOND_FP32)
    grad, param = special_table(2)
    p_ref = param.clone()
    st_ref = forge_dsl.init_state(str(path), p_ref)
    forge_dsl.reference_step(str(path), p_ref, grad, st_ref, step=1)
    p32 = param.clone().to(DEVICE)
    st32 = forge_dsl.init_state(str(path), p32, layout="fp32")
    kernels.step(str(path), p32, grad.to(DEVICE), st32, step=1, rounding="nearest")
    assert torch.isinf(st_ref["b_const"]).all() and (st_ref["b_const"] > 0).all()
    assert torch.equal(st_ref["b_where"], torch.where(grad > 0, INF, -INF))
    for name in st_ref:
        assert len(mismatches(st32[name], st_ref[name], zero_sign=name not in ("b_min", "b_clamp"))) == 0, name
        assert len(mismatches(st_ref[name], st_ref[name].double())) == 0, name
    # float64 parameters keep the constants: the reference computes in the parameter's dtype.
    p64 = param.double()
    st64 = forge_dsl.init_state(str(path), p64)
    forge_dsl.reference_step(str(path), p64, grad.double(), st64, step=1)
    assert (st64["b_const"] == 1e300).all()


def test_lion_nan_gradient_element():
    """sign(NaN) is NaN: built-in Lion writes NaN where the gradient is NaN, in kernel and reference alike,
    and the other elements are untouched by it."""
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(8, 64, generator=gen)
    g = torch.randn(8, 64, generator=gen)
    g[3, 17] = NAN
    hypers = {"lr": 1e-2, "weight_decay": 0.1}
    w32 = w.clone().to(DEVICE)
    st32 = forge_dsl.init_state("lion", w32, layout="fp32")
    kernels.step("lion", w32, g.to(DEVICE), st32, step=1, rounding="nearest", **hypers)
    w64 = w.double()
    st64 = forge_dsl.init_state("lion", w64)
    forge_dsl.reference_step("lion", w64, g.double(), st64, step=1, **hypers)
    assert torch.isnan(w64[3, 17]) and torch.isnan(w32[3, 17])
    assert torch.isnan(w64).sum() == 1 and torch.isnan(w32).sum() == 1
    assert len(mismatches(w32, w64)) == 0
    assert len(mismatches(st32["exp_avg"], st64["exp_avg"])) == 0


# ----------------------------------------------------------------------------
# The host side: float64 scalars (hyperparameters, step, scalar state, constant folding)
# ----------------------------------------------------------------------------

HOST_VALUES = [NAN, INF, -INF, 0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 0.5, -0.5, 3.0, -3.0, 1.5, -2.5, 1e-310,
               -1e-310, 1e300, -1e300, 401.0, -401.0, 1e20, -1e20, 7.0, -10.0, 800.0]
HOST_BINARY = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "pow": torch.pow,
               "atan2": torch.atan2, "min": torch.minimum, "max": torch.maximum}
HOST_UNARY = {"neg": torch.neg, "sqrt": torch.sqrt, "rsqrt": torch.rsqrt,
              "abs": torch.abs, "exp": torch.exp, "log": torch.log, "atan": torch.atan, "tanh": torch.tanh,
              "erf": torch.erf, "log1p": torch.log1p, "expm1": torch.expm1,
              "sign": lambda t: torch.where(torch.isnan(t) | (t == 0), t, torch.sign(t))}


def _same_float(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if a == b:
        return a != 0 or math.copysign(1, a) == math.copysign(1, b)
    return abs(a - b) <= 1e-15 * abs(b) + 1e-320  # a last-bit difference of the library functions


@pytest.mark.parametrize("op", sorted(HOST_BINARY) + sorted(HOST_UNARY))
def test_host_operations_match_torch_float64(op):
    """`scalar_ops` (what the host program and constant folding compute) is torch's float64 arithmetic,
    never an exception: `(-10.0) ** 401` is -inf and `(-0.0) ** -1` is -inf (Python raises on both)."""
    from forge_dsl.spec.scalar_ops import apply_scalar_op

    t = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    if op in HOST_BINARY:
        cases = [(a, b) for a in HOST_VALUES for b in HOST_VALUES]
        want = [HOST_BINARY[op](t(a), t(b)).item() for a, b in cases]
    else:
        cases = [(a,) for a in HOST_VALUES]
        want = [HOST_UNARY[op](t(a)).item() for (a,) in cases]
    bad = [(args, got, w) for args, w in zip(cases, want) if not _same_float(got := apply_scalar_op(op, *args), w)]
    assert not bad, f"{op}: {bad[:6]}"


# ----------------------------------------------------------------------------
# Host values reach the per-element program rounded once to fp32 (docs/LANGUAGE.md, section 6)
# ----------------------------------------------------------------------------

def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same fp32 values: NaN where the other is NaN, zeros of the same sign, everything else equal."""
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    nan = torch.isnan(a)
    return bool(torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan], b[~nan])
                and torch.equal(torch.signbit(a[~nan]), torch.signbit(b[~nan])))


def kernel_division_agrees(got: torch.Tensor, want: torch.Tensor) -> bool:
    """A kernel's result of fp32 divisions against IEEE's `want`: the same bits in the interpreter; compiled for
    an NVIDIA GPU, where `a / b` is `div.full.f32` (docs/LANGUAGE.md, "Numbers"), within 2 ulp of it where both
    are finite and not zero, and the same bits elsewhere (infinities, NaN, signed zeros)."""
    if DEVICE.type != "cuda":
        return same_bits(got, want)
    got = got.cpu()
    close = torch.isfinite(want) & (want != 0) & torch.isfinite(got)
    ulp = torch.nextafter(want.abs(), torch.tensor(INF)) - want.abs()
    return same_bits(got[~close], want[~close]) and bool(((got - want).abs() <= 2 * ulp)[close].all())


def run_fp32(path: str, grad: torch.Tensor, param: torch.Tensor, steps: int = 1, **hypers):
    """(kernel's, fp32 reference's) param and state after `steps` steps from the same fp32 inputs."""
    out = []
    for run in ("kernel", "reference"):
        p = param.clone().to(DEVICE if run == "kernel" else "cpu")
        st = forge_dsl.init_state(path, p, **({"layout": "fp32"} if run == "kernel" else {}), **hypers)
        for step in range(1, steps + 1):
            g = grad.to(p.device)
            if run == "kernel":
                kernels.step(path, p, g, st, step=step, rounding="nearest", **hypers)
            else:
                forge_dsl.reference_step(path, p, g, st, step=step, **hypers)
        out.append({"param": p.cpu(), **{k: v.cpu() for k, v in st.items()}})
    return out


def test_fp32_rounding_of_host_values_is_torchs():
    """`kernel_calls.kernel_host_values` rounds each float to nearest even fp32, as torch converts a Python
    float (halfway cases, the edges of fp32's range and its subnormals included); ints and bools stay."""
    from forge_dsl.kernels.kernel_calls import kernel_host_values

    gen = torch.Generator().manual_seed(7)
    ulp_steps = torch.randint(-3, 4, (2000,), generator=gen).double()
    base = (torch.randn(2000, generator=gen, dtype=torch.float64)
            * torch.exp2(torch.randint(-160, 140, (2000,), generator=gen).double())).float().double()
    halfway = base + ulp_steps * torch.abs(base) * 2.0**-25  # exact ties and near-ties of fp32
    values = halfway.tolist() + [NAN, INF, -INF, 0.0, -0.0, 1e-50, -1e-50, 1e-40, 1e39, -1e39, 3.4028235e38,
                                 3.4028235677973366e38, 3.4028235677973366e38 + 1.0141204801825835e31, 2.0**-150,
                                 2.0**-150 * 1.0000001, 2.0**-149, 0.1, 1 / 3]
    got = kernel_host_values(tuple(values) + (1, True, 2**40))
    assert got[-3:] == (1, True, 2**40) and type(got[-2]) is bool and type(got[-3]) is int
    want = torch.tensor(values, dtype=torch.float64).float().double().tolist()
    assert all(type(v) is float for v in got[:-3])
    bad = [(v, g, w) for v, g, w in zip(values, got, want)
           if not _same_float(g, w) or (g == 0 and math.copysign(1, g) != math.copysign(1, w))]
    assert not bad, bad[:6]


def test_adamw_eps_below_fp32_is_zero_in_the_kernel_as_in_torch():
    """`adamw(eps=1e-50)` at a zero gradient divides 0 by eps = 0 in fp32: NaN in torch, in the reference and in
    the kernel (which read eps as float64 and gave 0.999 * param)."""
    gen = torch.Generator().manual_seed(8)
    param = torch.randn(6, 70, generator=gen)
    grad = torch.zeros(6, 70)
    kern, ref = run_fp32("adamw", grad, param, eps=1e-50, lr=1e-3)
    theirs = param.clone().requires_grad_(True)
    opt = torch.optim.AdamW([theirs], lr=1e-3, eps=1e-50)
    theirs.grad = grad.clone()
    opt.step()
    assert torch.isnan(theirs).all()
    assert same_bits(ref["param"], theirs) and same_bits(kern["param"], theirs)


def test_host_chain_beyond_fp32_is_float64_then_rounded_once(tmp_path):
    """1,200 host temporaries growing by 1.5x reach 1e209: the host program keeps float64, so their ratio is
    1.5; read by the per-element program, each is rounded once to fp32 (inf), in the kernel as in the reference."""
    n = 1200
    body = "    t0 = lr\n" + "".join(f"    t{i} = t{i - 1} * 1.5\n" for i in range(1, n + 1))
    text = (f"optimizer host_chain\nhyper lr = 1e-2 in [0, inf)\nstate ratio = 0\nstate big = 0\nupdate {{\n{body}"
            f"    ratio = grad * (t{n} / t{n - 1})\n    big = grad * t{n} / t{n - 1}\n"
            "    param = param - lr * grad\n}\n")
    path = _spec_file(tmp_path, text)
    gen = torch.Generator().manual_seed(9)
    grad, param = torch.randn(4, 70, generator=gen), torch.randn(4, 70, generator=gen)
    kern, ref = run_fp32(path, grad, param)
    t = [1e-2]
    for _ in range(n):
        t.append(t[-1] * 1.5)
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731  a Python float met by fp32, as torch rounds it
    want = {"ratio": grad * f32(t[n] / t[n - 1]), "big": grad * f32(t[n]) / f32(t[n - 1])}
    assert torch.isnan(want["big"]).all() and torch.isfinite(want["ratio"]).all()
    for name, w in want.items():
        assert same_bits(ref[name], w), name
        assert same_bits(kern[name], w), name


def _spec_file(tmp_path, text: str) -> str:
    name = next(line.split()[1] for line in text.splitlines() if line.startswith("optimizer "))
    path = tmp_path / f"{name}.fopt"
    path.write_text(text)
    return str(path)


DIVISION_AND_ZEROS = """
optimizer division_and_zeros "element / host stays a division; x + 0 and 0 - x keep IEEE zeros"
hyper lr = 0.5 in [0, inf)
hyper s = 1e-40

state by_hyper = 0
state by_host = 0
state plus_zero = 0
state zero_minus = 0
state minus_zero = 0
state times_one = 0

update {
    by_hyper = grad / s * lr
    tiny = s * step
    by_host = grad / tiny * lr
    plus_zero = min(1 / (grad + 0), 1)
    zero_minus = 1 / (0 - grad)
    minus_zero = 1 / (grad - 0)
    times_one = 1 / (grad * 1)
    param = param - lr * grad
}
"""


def test_division_by_a_host_value_and_additions_of_zero_are_ieee_fp32(tmp_path):
    """`grad / s * lr` with a subnormal s was `grad * (1 / s) * lr`: 1 / s is inf in fp32, so the reference gave
    -inf where IEEE fp32 and torch give -1e6; `grad + 0` was folded to `grad` and `0 - grad` to `-grad`, wrong
    at -0.0 and +0.0. The reference and torch's fp32 arithmetic agree bit for bit, and the kernel in the
    interpreter; compiled, within the GPU's division (`kernel_division_agrees`)."""
    path = _spec_file(tmp_path, DIVISION_AND_ZEROS)
    gen = torch.Generator().manual_seed(10)
    grad = torch.randn(4, 70, generator=gen) * 1e-34
    grad.view(-1)[:8] = torch.tensor([0.0, -0.0, NAN, INF, -INF, 1e-34, -2e-34, 1.0])
    param = torch.randn(4, 70, generator=gen)
    kern, ref = run_fp32(path, grad, param)
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    s, lr = f32(1e-40), f32(0.5)
    want = {"by_hyper": grad / s * lr, "by_host": grad / f32(1e-40 * 1) * lr,
            "plus_zero": torch.minimum(1 / (grad + 0.0), f32(1.0)), "zero_minus": 1 / (0.0 - grad),
            "minus_zero": 1 / (grad - 0.0), "times_one": 1 / (grad * 1.0)}
    by_hyper = want["by_hyper"].view(-1)
    assert torch.isfinite(by_hyper[5]) and by_hyper[5] == -0.5 * by_hyper[6]  # 1e-34 / 1e-40: about 1e6
    assert want["plus_zero"].view(-1)[1] == 1 and want["zero_minus"].view(-1)[0] == INF
    for name, w in want.items():
        for label, got in (("reference", ref[name]), ("kernel", kern[name])):
            differ = torch.nonzero(~((got == w) | (got.isnan() & w.isnan()))).flatten()
            agrees = same_bits(got, w) if label == "reference" else kernel_division_agrees(got, w)
            assert agrees, (name, label, describe(differ, grad, param, got, w))


SUBNORMAL_HOST = """
optimizer subnormal_host "a host value that is an fp32 subnormal"
hyper lr = 0.5 in [0, inf)
hyper s = 1e-40
state q = 0
update {
    q = grad * s / s
    param = param - lr * grad
}
"""


def test_subnormal_host_value_is_fp32_arithmetic(tmp_path):
    path = _spec_file(tmp_path, SUBNORMAL_HOST)
    grad = torch.tensor([[1.2345678, 3.3, -7.1, 0.1]]).repeat(2, 16)
    kern, ref = run_fp32(path, grad, torch.zeros_like(grad))
    s = torch.tensor(1e-40, dtype=torch.float32)
    assert same_bits(ref["q"], grad * s / s)
    assert kernel_division_agrees(kern["q"], grad * s / s)


# ----------------------------------------------------------------------------
# Outputs that are plain inputs, and a flag derived from a hyperparameter declared after it
# ----------------------------------------------------------------------------

PLAIN_OUTPUT = """
optimizer {name} "the gradient only copied into a state"
hyper lr = 1e-2 in [0, inf)
state prev = 0
update {{
    param = param - lr * prev
    prev = {copy}
}}
"""


@pytest.mark.parametrize("copy", ["grad", "grad * 1", "-(-grad)"])
def test_gradient_only_copied_into_a_state(copy, tmp_path):
    """`prev = grad` (or what simplifies to it) made the reference raise KeyError: 'grad'."""
    path = _spec_file(tmp_path, PLAIN_OUTPUT.format(name="copied_grad", copy=copy))
    gen = torch.Generator().manual_seed(11)
    param = torch.randn(3, 70, generator=gen, dtype=torch.float64)
    grads = [torch.randn(3, 70, generator=gen, dtype=torch.float64) for _ in range(3)]
    p64, p32 = param.clone(), param.float().to(DEVICE)
    st64, st32 = forge_dsl.init_state(path, p64), forge_dsl.init_state(path, p32, layout="fp32")
    want, prev = param.clone(), torch.zeros_like(param)
    for step, g in enumerate(grads, start=1):
        forge_dsl.reference_step(path, p64, g, st64, step=step)
        kernels.step(path, p32, g.float().to(DEVICE), st32, step=step, rounding="nearest")
        want, prev = want - 1e-2 * prev, g
    assert torch.allclose(p64, want, rtol=1e-14, atol=0) and torch.equal(st64["prev"], grads[-1])
    assert torch.equal(st32["prev"].cpu(), grads[-1].float()) and len(mismatches(p32.cpu(), want)) == 0


FLAG_BEFORE_HYPER = """
optimizer flag_first "a derived flag written above the hyperparameter it reads"
flag moving = lr > 0
hyper lr = 1e-2 in [0, inf)
update {
    param = where(moving, param - lr * grad, param)
}
"""


@pytest.mark.parametrize("lr", [0.0, 0.1])
def test_flag_derived_from_a_hyperparameter_declared_after_it(lr, tmp_path):
    """Declarations come in any order (docs/LANGUAGE.md 2, 3.3): with lr = 0 the update is `param = param`,
    which made the reference raise KeyError: 'param'."""
    path = _spec_file(tmp_path, FLAG_BEFORE_HYPER)
    gen = torch.Generator().manual_seed(12)
    param = torch.randn(3, 70, generator=gen, dtype=torch.float64)
    grad = torch.randn(3, 70, generator=gen, dtype=torch.float64)
    p64, p32 = param.clone(), param.float().to(DEVICE)
    forge_dsl.reference_step(path, p64, grad, forge_dsl.init_state(path, p64), step=1, lr=lr)
    kernels.step(path, p32, grad.float().to(DEVICE), forge_dsl.init_state(path, p32, layout="fp32"), step=1,
                 rounding="nearest", lr=lr)
    want = param - lr * grad
    assert torch.allclose(p64, want, rtol=1e-15, atol=0) and len(mismatches(p32.cpu(), want)) == 0


# ----------------------------------------------------------------------------
# Schedule-free AdamW with an AMSGrad-style bound (issue J, 11)
# ----------------------------------------------------------------------------

SF_ADAMW_AMS = """
# Schedule-free AdamW (Defazio et al., 2024; constant weights c = 1 / step) whose ams_bound keeps a running
# maximum of the bias-corrected second moment. 1 - beta2 ** step is in (0, 1] for beta2 in [0, 1) and
# step >= 1, so the corrected moment, and its maximum, are non-negative.
optimizer sf_adamw_ams "schedule-free AdamW with an optional ams_bound"

hyper lr = 2.5e-3 in [0, inf)
hyper betas = (beta1 = 0.9, beta2 = 0.999) in [0, 1)
hyper eps = 1e-8 in [0, inf)
hyper weight_decay = 0 in [0, inf)
flag ams_bound = false

state z = param
state avg = param exact
state exp_avg_sq = 0 nonneg
state max_exp_avg_sq = 0 nonneg if ams_bound

update {
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
    corrected = exp_avg_sq / (1 - beta2 ** step)
    if ams_bound {
        max_exp_avg_sq = max(max_exp_avg_sq, corrected)
        denom = sqrt(max_exp_avg_sq) + eps
    } else {
        denom = sqrt(corrected) + eps
    }
    z = z - lr * (grad / denom + weight_decay * param)
    c = 1 / step
    avg = (1 - c) * avg + c * z
    param = (1 - beta1) * z + beta1 * avg
}
"""


def _sf_adamw_torch(p, grads, lr, beta1, beta2, eps, weight_decay, ams_bound):
    """SF_ADAMW_AMS written out in torch."""
    z, avg = p.clone(), p.clone()
    v, v_max = torch.zeros_like(p), torch.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        v = beta2 * v + (1 - beta2) * g * g
        corrected = v / (1 - beta2**t)
        if ams_bound:
            v_max = torch.maximum(v_max, corrected)
        denom = (v_max if ams_bound else corrected).sqrt() + eps
        z = z - lr * (g / denom + weight_decay * p)
        avg = (1 - 1 / t) * avg + (1 / t) * z
        p = (1 - beta1) * z + beta1 * avg
    return p, {"z": z, "avg": avg, "exp_avg_sq": v, **({"max_exp_avg_sq": v_max} if ams_bound else {})}


@pytest.mark.parametrize("ams_bound", [False, True])
def test_schedule_free_adamw_with_ams_bound_loads_and_kernels_agree(ams_bound, tmp_path):
    path = _spec_file(tmp_path, SF_ADAMW_AMS)
    spec = forge_dsl.load_spec(path)
    assert [s.name for s in spec.states if s.nonneg] == ["exp_avg_sq", "max_exp_avg_sq"]
    keywords = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, ams_bound=ams_bound)
    gen = torch.Generator().manual_seed(13)
    param = torch.randn(5, 70, generator=gen, dtype=torch.float64)
    grads = [torch.randn(5, 70, generator=gen, dtype=torch.float64) * (2.0 if t % 2 else 0.5) for t in range(4)]
    want_p, want_state = _sf_adamw_torch(param, grads, 1e-2, 0.9, 0.99, 1e-8, 0.1, ams_bound)
    p64, p32 = param.clone(), param.float().to(DEVICE)
    st64, st32 = forge_dsl.init_state(path, p64, **keywords), forge_dsl.init_state(path, p32, layout="fp32", **keywords)
    for step, g in enumerate(grads, start=1):
        forge_dsl.reference_step(path, p64, g, st64, step=step, **keywords)
        kernels.step(path, p32, g.float().to(DEVICE), st32, step=step, rounding="nearest", **keywords)
    p32, st32 = p32.cpu(), {k: v.cpu() for k, v in st32.items()}
    assert set(st64) == set(want_state)
    assert torch.allclose(p64, want_p, rtol=1e-12, atol=0)
    assert (p32.double() - want_p).norm() <= 1e-5 * want_p.norm()
    for name, want in want_state.items():
        assert torch.allclose(st64[name], want, rtol=1e-12, atol=0), name
        assert (st32[name].double() - want).norm() <= 1e-5 * want.norm(), name
