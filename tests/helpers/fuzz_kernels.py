"""The fuzz tests' kernel check: a loaded spec's element-wise kernel against its float64 reference step.

`check_kernel(spec, seed)` draws a flag combination and hyperparameters inside their ranges
(`forge_dsl.testing.draw_keywords`), a random 4 × 70 weight (one ragged 64 × 128 block in the
interpreter) with fp32 state from `init_state`, and runs `STEPS` steps of `forge_dsl.kernels.step`,
each on a fresh random gradient. Each step is compared, from the same start (the kernel's weight
and state before it), with `forge_dsl.reference_step` in float64: the weight, every state and every
scalar state.

How close is close enough: fuzzed specs can be as ill-conditioned as they like (cancellation, huge
exponents, division by values that rounding moves across zero), so no one relative tolerance fits.
`error_bounds` runs the step's lowered per-element program (`lowering.lower`, the program both the
kernel and `reference_step` run) in float64 as an interval computation: each value is a centre, the
exact result, and a radius that bounds how far an fp32 evaluation of the same operations can be from
it (Higham's running error analysis, with exact intervals through monotone operations):

* inputs (the weight, the gradient, fp32 states) are exact; a constant or host value enters as the
  float64 number the reference reads, with the radius |fp32(x) − x| (the kernels read it rounded);
* every operation maps its arguments' intervals: for operations monotone in each argument (all but
  `abs`, `where`, `==`, `!=`, and `/`, `rsqrt`, `pow`, `atan2` at their poles) through the corners
  of the box, which bound the image exactly; a pole inside the box, or corners that disagree on NaN
  or infinity, make the radius infinite: the element is uncertain;
* then the operation's own rounding, relative to the result (`ROUNDING`, in units of u = 2⁻²⁴):
  1 for `+ - *` (IEEE in the interpreter), 4 for `/`, `sqrt`, `rsqrt`, `exp`, `log` (room for the
  GPU's approximate ones), 8 for `atan`, `atan2`, `tanh`, `erf`, `log1p`, `expm1` (docs/LANGUAGE.md
  8.1: within 4e-7 relative), and for `**` its documented 1.2e-7 · |y log2 |x|| (doubled) plus the
  multiplications of a constant integer exponent; plus 2⁻¹⁴⁹ absolute (subnormals);
* fp32's range: an interval above the largest fp32 number is `inf` (what the kernel must give), one
  that straddles it uncertain.

An element passes when it is uncertain, or the centre is NaN and so is the kernel, or the centre is an
infinity and the kernel the same one, or both are finite and |kernel − centre| ≤ `SAFETY` · radius.
Booleans carry whether rounding could flip them (intervals that overlap); a `where` on an uncertain
condition spans both branches. The centre is the float64 reference's value wherever fp32's range
played no part (checked: `reference_step` in float64 from the same start, element by element).
The bound is rigorous for IEEE operations, so the check cannot fail on conditioning; and it is
tight where the spec is well conditioned (a few ulps), so a wrong operation fails it at once
(tests/spec/test_fuzz.py misspells `-` as `+` in the code generator to show it).
"""

from __future__ import annotations

import itertools
import linecache
import math
import os
import random
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch

import forge_dsl
from forge_dsl.spec import ir
from forge_dsl import kernels
from forge_dsl.spec.variants import combinations
from forge_dsl.spec.keywords import resolve_hypers
from forge_dsl.compiler import loader as compiled
from forge_dsl.compiler.lowering import Lowered, Operand, lower
from forge_dsl.eager import elementwise as _elementwise
from forge_dsl.reference import _host_value, run_host_program
from forge_dsl.testing import draw_keywords

__all__ = ["check_kernel", "error_bounds", "Outcome", "KernelMismatch", "forget_module", "SHAPE", "STEPS"]

SHAPE = (4, 70)  # one ragged block of the element-wise kernel in the interpreter (64 × 128)
STEPS = 3
SAFETY = 2.0  # the radius already bounds the error; this covers "about" in the documented accuracies
COMBO_TRIES = 4  # flag combinations tried before a spec counts as unreachable (requires that cannot be met)

U = 2.0**-24  # fp32's unit roundoff
TINY = 2.0**-149  # fp32's smallest subnormal: the absolute rounding of results in the subnormal range
FLT_MAX = 3.4028234663852886e38
OVERFLOW = 2.0**128 * (1 - 2.0**-25)  # the smallest value that rounds to inf
ROUNDING = {"add": 1, "sub": 1, "mul": 1, "div": 4, "sqrt": 4, "rsqrt": 4, "exp": 4, "log": 4,
            "atan": 8, "atan2": 8, "tanh": 8, "erf": 8, "log1p": 8, "expm1": 8}
EXACT = {"neg", "abs", "sign", "min", "max", "clamp", "where"}
MONOTONE = {"add", "sub", "mul", "div", "sqrt", "rsqrt", "exp", "log", "atan", "atan2", "tanh", "erf",
            "log1p", "expm1", "pow", "sign", "min", "max", "clamp", "neg"}
ORDER = {"lt", "le", "gt", "ge"}


class KernelMismatch(AssertionError):
    """The kernel's result is outside the bound of the float64 reference (the message says where)."""


@dataclass
class Outcome:
    """What one `check_kernel` did: `checked` False with a `reason` when the spec was skipped."""

    checked: bool
    reason: str = ""
    elements: int = 0  # element results compared (outputs × elements × steps)
    certain: int = 0  # of which the bound was finite (not uncertain)
    special: int = 0  # of which the reference was NaN or an infinity
    keywords: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------
# Interval evaluation of the lowered per-element program
# ----------------------------------------------------------------------------


@dataclass
class _Real:
    v: torch.Tensor  # float64 centre
    e: torch.Tensor  # float64 radius >= 0, inf where uncertain
    clamped: torch.Tensor  # bool: fp32's range changed the centre here or upstream


@dataclass
class _Bool:
    v: torch.Tensor
    unsure: torch.Tensor
    clamped: torch.Tensor


def _same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element-wise: equal, NaN counting equal to NaN."""
    return (a == b) | (torch.isnan(a) & torch.isnan(b))


def _number(x: float, like: torch.Tensor) -> _Real:
    """A constant or host value: the float64 number, radius |fp32(x) − x|; inf where fp32 overflows."""
    v64 = torch.full_like(like, x, dtype=torch.float64)
    v32 = v64.float().double()
    overflow = torch.isinf(v32) & torch.isfinite(v64)
    e = torch.where(torch.isfinite(v64), (v32 - v64).abs(), torch.zeros_like(v64))
    return _Real(torch.where(overflow, v32, v64), torch.where(overflow, torch.zeros_like(e), e), overflow)


def _corners(r: _Real) -> list[torch.Tensor]:
    """The ends of an interval (its centre where the radius is 0, keeping the sign of a zero)."""
    return [torch.where(r.e == 0, r.v, r.v - r.e), torch.where(r.e == 0, r.v, r.v + r.e)]


def _through(op: str, args: list[_Real]) -> tuple[torch.Tensor, torch.Tensor]:
    """(centre, radius before rounding) of an operation monotone in each argument, from the corners of the box."""
    centre = _elementwise(op, [a.v for a in args])
    spread = torch.zeros_like(centre)
    bad = torch.zeros_like(centre, dtype=torch.bool)
    for corner in itertools.product(*(_corners(a) for a in args)):
        r = _elementwise(op, list(corner))
        finite = torch.isfinite(centre)
        spread = torch.maximum(spread, torch.where(finite & torch.isfinite(r), (r - centre).abs(), spread))
        bad |= torch.where(finite, ~torch.isfinite(r), ~_same(r, centre))
    return centre, torch.where(bad, math.inf, spread)


def _straddles_zero(r: _Real) -> torch.Tensor:
    return (r.e > 0) & (r.v.abs() <= r.e)


def _rounding(op: str, args: list[_Real], centre: torch.Tensor) -> torch.Tensor:
    """The operation's own rounding, relative to its result."""
    if op != "pow":
        return torch.full_like(centre, ROUNDING[op] * U)
    x, y = args[0].v, args[1].v
    log_term = (y * torch.log2(x.abs())).abs()
    log_term = torch.where((x == 0) | (y == 0) | ~torch.isfinite(log_term), torch.zeros_like(log_term), log_term)
    return 2.4e-7 * log_term + (2 * torch.clamp(y.abs(), max=33.0) + 8) * U


def _real_op(op: str, args: list[_Real]) -> _Real:
    clamped = torch.zeros_like(args[0].v, dtype=torch.bool)
    for a in args:
        clamped = clamped | a.clamped
    uncertain = torch.zeros_like(clamped)
    for a in args:
        uncertain |= torch.isinf(a.e)
    if op == "abs":
        centre, prop = _elementwise(op, [args[0].v]), args[0].e.clone()
    else:
        assert op in MONOTONE, f"fuzz_kernels has no interval rule for '{op}': add one"
        centre, prop = _through(op, args)
    if op == "div":
        uncertain |= _straddles_zero(args[-1])
    elif op == "rsqrt":
        uncertain |= _straddles_zero(args[0])
    elif op == "pow":
        uncertain |= _straddles_zero(args[0])
    elif op == "atan2":
        uncertain |= _straddles_zero(args[0]) & (_straddles_zero(args[1]) | (args[1].v == 0))
        uncertain |= (args[0].v == 0) & _straddles_zero(args[1])
    prop = torch.where(uncertain, math.inf, prop)
    e = prop
    if op not in EXACT:
        tiny = torch.where((centre != 0) | (prop > 0), TINY, 0.0)
        rounded = prop + _rounding(op, args, centre) * (centre.abs() + prop) + tiny
        e = torch.where(torch.isfinite(centre), rounded, prop)
    # fp32's range: certainly beyond it is inf, possibly beyond it uncertain
    finite = torch.isfinite(centre) & torch.isfinite(e)
    over = finite & (centre.abs() - e > OVERFLOW)
    maybe = finite & ~over & (centre.abs() + e >= FLT_MAX)
    centre = torch.where(over, torch.copysign(torch.full_like(centre, math.inf), centre), centre)
    e = torch.where(over, 0.0, torch.where(maybe, math.inf, e))
    e = torch.where(torch.isnan(e), math.inf, e)
    return _Real(centre, e, clamped | over)


def _compare(op: str, a: _Real, b: _Real) -> _Bool:
    centre = _elementwise(op, [a.v, b.v])
    clamped = a.clamped | b.clamped
    unsure = torch.isinf(a.e) | torch.isinf(b.e)
    if op in ORDER:
        for ca, cb in itertools.product(_corners(a), _corners(b)):
            unsure |= _elementwise(op, [ca, cb]) != centre
    else:  # == and !=: sure when both are exact, or the intervals are apart
        apart = (a.v - b.v).abs() > a.e + b.e
        exact = (a.e == 0) & (b.e == 0)
        unsure |= ~(apart | exact | torch.isnan(a.v) | torch.isnan(b.v))
    return _Bool(centre, unsure, clamped)


def _logic(op: str, args: list[_Bool]) -> _Bool:
    clamped = args[0].clamped
    for a in args[1:]:
        clamped = clamped | a.clamped
    if op == "not":
        return _Bool(~args[0].v, args[0].unsure, clamped)
    a, b = args
    sure_a, sure_b = ~a.unsure, ~b.unsure
    if op == "and":
        sure = (sure_a & ~a.v) | (sure_b & ~b.v) | (sure_a & sure_b)
        return _Bool(a.v & b.v, ~sure, clamped)
    sure = (sure_a & a.v) | (sure_b & b.v) | (sure_a & sure_b)
    return _Bool(a.v | b.v, ~sure, clamped)


def _where(c: _Bool, a, b):
    clamped = c.clamped | a.clamped | b.clamped
    if isinstance(a, _Bool):
        v = torch.where(c.v, a.v, b.v)
        unsure = torch.where(c.v, a.unsure, b.unsure) | (c.unsure & ((a.v != b.v) | a.unsure | b.unsure))
        return _Bool(v, unsure, clamped)
    v = torch.where(c.v, a.v, b.v)
    e = torch.where(c.v, a.e, b.e)
    other = torch.where(c.v, b.v, a.v)
    gap = torch.where(_same(other, v), torch.zeros_like(v), (other - v).abs())
    gap = torch.where(torch.isnan(gap), math.inf, gap)
    e = torch.where(c.unsure, torch.maximum(a.e, b.e) + gap, e)
    return _Real(v, e, clamped)


def error_bounds(low: Lowered, host: dict, inputs: dict[str, torch.Tensor]) -> dict[str, _Real]:
    """Each output of the per-element program ('param' or a state name) as (centre, radius, clamped).

    low: the lowered program of the step's combination; host: `run_host_program`'s values;
    inputs: the step's fp32 inputs by name ('param', 'grad', state names), shaped alike.
    """
    like = inputs["param"].double()
    env: dict[str, object] = {}

    def value(o: Operand):
        if o.kind == "const" or o.is_host:
            x = _host_value(o, host)
            if isinstance(x, bool):
                full = torch.full_like(like, x, dtype=torch.bool)
                return _Bool(full, torch.zeros_like(full), torch.zeros_like(full))
            return _number(float(x), like)
        if o.kind == "elem":
            return env[o.name]
        t = inputs[o.kind if o.kind in ("param", "grad") else o.name].double()
        zero = torch.zeros_like(t)
        return _Real(t, zero, zero.bool())

    for instr in low.elem:
        args = [value(a) for a in instr.args]
        if instr.op == "where":
            env[instr.name] = _where(*args)
        elif instr.op in ("and", "or", "not"):
            env[instr.name] = _logic(instr.op, args)
        elif instr.op in ORDER or instr.op in ("eq", "ne"):
            env[instr.name] = _compare(instr.op, *args)
        else:
            env[instr.name] = _real_op(instr.op, args)
    return {target: value(o) for target, o in low.outputs}


# ----------------------------------------------------------------------------
# One spec's check
# ----------------------------------------------------------------------------


def _keywords(spec: ir.Spec, rng: random.Random) -> Optional[dict]:
    combos = combinations(spec)
    for combo in rng.sample(combos, min(COMBO_TRIES, len(combos))):
        kw = draw_keywords(spec, combo, rng)
        if kw is not None:
            return kw
    return None


def _describe(spec: ir.Spec, kw: dict, step: int, target: str, index: tuple, got: float, ref: _Real, r64: float,
              start: dict) -> str:
    i = index
    inputs = ", ".join(f"{k}={float(v[i]):.9g}" for k, v in start.items())
    return (f"{spec.name}: step {step}, '{target}'[{', '.join(map(str, i))}]: kernel {got!r}, float64 reference "
            f"{r64!r}, bound centre {float(ref.v[i])!r} ± {float(ref.e[i]):.3g} (x{SAFETY}); inputs {inputs}; "
            f"keywords {kw}\n--- spec ---\n{spec.source}")


def _compare_outputs(spec, kw, step, outs: dict, bounds: dict, ref64: dict, start: dict, outcome: Outcome) -> None:
    for target, b in bounds.items():
        k = outs[target].double()
        r64 = ref64[target]
        # the bound's centre is the float64 reference wherever fp32's range played no part
        off = ~b.clamped & ~_same(b.v, r64)
        if off.any():
            i = tuple(int(j) for j in off.nonzero()[0])
            raise AssertionError(f"fuzz_kernels' interval centre differs from reference_step in float64: "
                                 f"{_describe(spec, kw, step, target, i, float(k[i]), b, float(r64[i]), start)}")
        sure = torch.isfinite(b.e)
        nan = torch.isnan(b.v)
        inf = torch.isinf(b.v)
        finite = ~nan & ~inf
        ok = ~sure | (nan & torch.isnan(k)) | (inf & (k == b.v))
        ok |= finite & torch.isfinite(k) & ((k - b.v).abs() <= SAFETY * b.e)
        outcome.elements += k.numel()
        outcome.certain += int(sure.sum())
        outcome.special += int((sure & ~finite).sum())
        if not ok.all():
            i = tuple(int(j) for j in (~ok).nonzero()[0])
            raise KernelMismatch(f"{int((~ok).sum())} element(s) outside the bound; the first: "
                                 f"{_describe(spec, kw, step, target, i, float(k[i]), b, float(r64[i]), start)}")


def check_kernel(spec: ir.Spec, seed: int) -> Outcome:
    """Run `STEPS` kernel steps of `spec` on a random problem drawn from `seed`; raise `KernelMismatch` where
    an element is outside the reference's bound (module docstring), AssertionError where a scalar state
    differs. Returns what was compared, or why the spec was skipped (no reachable flag combination)."""
    rng = random.Random(seed)
    kw = _keywords(spec, rng)
    if kw is None:
        return Outcome(False, "no flag combination's requires can be met")
    cfg = resolve_hypers(spec, kw)
    low = lower(spec, cfg.combo)
    gen = torch.Generator().manual_seed(seed)
    p_scale, g_scale = 10 ** rng.uniform(-1, 0.5), 10 ** rng.uniform(-3, 0)
    param = torch.randn(SHAPE, generator=gen) * p_scale
    state = forge_dsl.init_state(spec, param, layout="fp32", **kw)
    outcome = Outcome(True, keywords=kw)
    for step in range(1, STEPS + 1):
        grad = torch.randn(SHAPE, generator=gen) * g_scale
        start = {"param": param.clone(), "grad": grad.clone(),
                 **{name: state[name].clone() for name in low.states}}
        scalars = {s.name: float(state[s.name]) for s in spec.scalars}
        # float64 reference from the same start
        p64 = param.double()
        s64 = {name: (t.double() if t.dim() else t.clone()) for name, t in state.items()}
        forge_dsl.reference_step(spec, p64, grad.double(), s64, step=step, **kw)
        # the kernel
        kernels.step(spec, param, grad, state, step=step, **kw)
        host = run_host_program(low, cfg.host_inputs, step, scalars)
        bounds = error_bounds(low, host, start)
        outs = {"param": param, **{name: state[name] for name in low.states}}
        ref64 = {"param": p64, **{name: s64[name] for name in low.states}}
        _compare_outputs(spec, kw, step, outs, bounds, ref64, start, outcome)
        for s in spec.scalars:
            got, want = float(state[s.name]), float(s64[s.name])
            assert got == want or (math.isnan(got) and math.isnan(want)), (
                f"{spec.name}: step {step}, scalar state '{s.name}': kernel host code {got!r}, reference "
                f"{want!r}; keywords {kw}\n--- spec ---\n{spec.source}")
    return outcome


def forget_module(spec: ir.Spec) -> None:
    """Drop the compiled module of `spec` from the loader's memory and its file from the cache folder, so
    that thousands of fuzzed specs neither fill memory nor the disk."""
    hit = compiled._BY_SPEC_OBJECT.pop(id(spec), None)
    if hit is None:
        return
    module = hit[1]
    path = getattr(module, "__file__", "")
    if not str(path).startswith(str(compiled.cache_dir())):
        return  # a committed module: leave it loaded
    for key in [k for k, m in compiled._LOADED.items() if m is module]:
        del compiled._LOADED[key]
    sys.modules.pop(module.__name__, None)
    linecache.cache.pop(path, None)
    compiled._compiled.cache_clear()
    try:
        os.unlink(path)
    except OSError:
        pass
