"""The proof that a state declared `nonneg` starts and stays >= 0: interval analysis of a specialized update.

    check_nonneg(spec, combo, qualify)     raises a located SpecError where a nonneg state's new value can be < 0

Hyperparameters take their declared ranges, `step` is >= 1, nonneg states are >= 0, everything else
per-element is unbounded; `_Bounds` gives each value a `_Range`. The forms the proof knows are
`PROVEN_FORMS`; int8 / int4 storage of a nonneg state uses an unsigned map that clamps at 0, which is why the
declaration must hold.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from . import ir
from .errors import SpecError
from .printer import print_expr
from .variants import Combo, describe_combo, eval_static, specialize, states_present

__all__ = ["check_nonneg", "PROVEN_FORMS"]


def check_nonneg(spec: ir.Spec, combo: Combo, qualify: bool) -> None:
    """Every `nonneg` state present for `combo` starts and stays >= 0, by interval analysis (`_Bounds`).

    Raises:
        SpecError: at the initial value or the assignment that can be negative; `qualify` names the flag
            values in the message (where the problem depends on them).
    """
    flags = dict(combo)
    why = f" (when {describe_combo(combo)})" if qualify and combo else ""
    bounds = _Bounds(spec, flags)
    present = {s.name for s in states_present(spec, flags)}
    nonneg = {s.name: s for s in spec.states if s.nonneg and s.name in present}
    for s in nonneg.values():
        if bounds.of(s.init).lo < 0:
            raise SpecError(f"state '{s.name}' is declared nonneg but its initial value can be negative",
                            s.init.loc, spec.source, hint="remove 'nonneg' or start it at a value >= 0")
    for stmt in specialize(spec.body, flags):
        bounds.notes.clear()
        r = bounds.of(stmt.value)
        if stmt.target in nonneg and r.lo < 0:
            hint = bounds.notes[-1] if bounds.notes else (
                "the proof knows the hyperparameters' ranges, step >= 1, nonneg states >= 0 and "
                f"{PROVEN_FORMS}; narrow a range, write the value in one of these forms, or remove 'nonneg' "
                "(int8 storage of a nonneg state uses an unsigned map that clamps at 0)"
            )
            raise SpecError(
                f"state '{stmt.target}' is declared nonneg, but this value can be negative{why}"
                f" (its lower bound is {ir.format_number(r.lo)})",
                stmt.value.loc, spec.source, hint=hint,
            )
        bounds.assign(stmt.target, _Range(max(r.lo, 0.0), max(r.hi, 0.0), r.nan) if stmt.target in nonneg else r)


_INF = math.inf
_FP32_ZERO = 2.0**-150  # the largest magnitude that rounds to a zero in fp32 (to nearest even)


@dataclass(frozen=True)
class _Range:
    """What the analysis knows of a value: every non-NaN value lies in [lo, hi]; `nan`: it may be NaN.

    Bounds are never NaN (a bound computation that gives NaN, such as inf + -inf, means
    unbounded on that side).  Zero's sign is not tracked: a range that reaches 0 may hold
    -0.0, so dividing by it (or rsqrt of it) can give -inf.  `lo_open` / `hi_open`: that end
    is not reached (`beta2 in [0, 1)`, so `1 - beta2 ** step` is in (0, 1], and dividing by it
    keeps a sign); kept through negation, sums (an end at 0) and the powers `_power` knows, dropped
    (closed, which is sound) elsewhere.  `integer`: every value is an integer (`step`).
    """

    lo: float
    hi: float
    nan: bool = False
    lo_open: bool = False
    hi_open: bool = False
    integer: bool = False

    @staticmethod
    def of(lo: float, hi: float, nan: bool) -> "_Range":
        return _Range(-_INF if math.isnan(lo) else lo, _INF if math.isnan(hi) else hi, nan)

    def has(self, x: float) -> bool:
        return self.lo <= x <= self.hi

    def union(self, other: "_Range") -> "_Range":
        return _Range(min(self.lo, other.lo), max(self.hi, other.hi), self.nan or other.nan)


_ANY = _Range(-_INF, _INF, True)
_UNIT = _Range(0.0, 1.0)  # booleans, and the weights of the moving averages below


def _times(x: float, y: float) -> float:
    return 0.0 if x == 0 or y == 0 else x * y  # 0 * inf counts as 0 (a bound, not a value: see `_mul`)


def _mul(a: _Range, b: _Range) -> _Range:
    products = [_times(x, y) for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
    # 0 * inf is NaN: the only value the 0-as-product bounds above leave out.
    nan = a.nan or b.nan or (a.has(0) and math.isinf(max(-b.lo, b.hi))) or (b.has(0) and math.isinf(max(-a.lo, a.hi)))
    return _Range.of(min(products), max(products), nan)


def _add(a: _Range, b: _Range) -> _Range:
    nan = a.nan or b.nan or (a.hi == _INF and b.lo == -_INF) or (a.lo == -_INF and b.hi == _INF)
    r = _Range.of(a.lo + b.lo, a.hi + b.hi, nan)
    # An end at 0 that one side does not reach, the sum does not reach either, in floating point too: a sum is
    # 0 only where the exact sum is (1 - beta2 > 0 for beta2 < 1). At other ends rounding may reach the bound.
    return _Range(r.lo, r.hi, nan, lo_open=r.lo == 0 and (a.lo_open or b.lo_open),
                  hi_open=r.hi == 0 and (a.hi_open or b.hi_open))


def _neg(a: _Range) -> _Range:
    return _Range(-a.hi, -a.lo, a.nan, lo_open=a.hi_open, hi_open=a.lo_open, integer=a.integer)


def _monotone(f, a: _Range, low: float, high: float) -> _Range:
    """An increasing function with values in [low, high], applied to a."""

    def at(x: float, fallback: float) -> float:
        try:
            return f(x)
        except (OverflowError, ValueError):
            return fallback

    return _Range.of(max(low, at(a.lo, low)), min(high, at(a.hi, high)), a.nan)


def _min(a: _Range, b: _Range) -> _Range:
    out = _Range(min(a.lo, b.lo), min(a.hi, b.hi), a.nan or b.nan)
    # Where one side is NaN the kernels and the reference give NaN (docs/LANGUAGE.md 8.1); the union with the
    # other side keeps the proof sound for a spelling that returned the other operand instead.
    if a.nan:
        out = out.union(b)
    if b.nan:
        out = out.union(a)
    return out


def _max(a: _Range, b: _Range) -> _Range:
    return _neg(_min(_neg(a), _neg(b)))


def _factors(e: ir.Expr) -> list[ir.Expr]:
    """The factors of a product `a * b * c` (a single factor for anything else), left to right."""
    out: list[ir.Expr] = []
    stack = [e]
    while stack:
        x = stack.pop()
        if isinstance(x, ir.Binary) and x.op == "mul":
            stack += [x.right, x.left]
        else:
            out.append(x)
    return out


def _remove(items: list[ir.Expr], wanted: list[ir.Expr]) -> Optional[list[ir.Expr]]:
    """`items` less one occurrence of each of `wanted` (compared as trees), or None if one is missing."""
    rest = list(items)
    for w in wanted:
        i = next((i for i, x in enumerate(rest) if x == w), None)
        if i is None:
            return None
        rest.pop(i)
    return rest


def _const_value(e: ir.Expr) -> Optional[float]:
    if isinstance(e, ir.Num):
        return e.value
    if isinstance(e, ir.Unary) and e.op == "neg":
        v = _const_value(e.operand)
        return None if v is None else -v
    return None


# The forms the proof knows, as the nonneg hint quotes them.
PROVEN_FORMS = (
    "squares (x * x, c * g * g, x ** 2), sqrt, abs, exp, sums and products of non-negative values, their "
    "quotients by positive values, min of non-negative values, max with a non-negative side; the moving averages v + c * (x - v), v - c * (v - x) and (1 - c) * v + c * x; "
    "and Yogi's v - c * sign(v - x) * x; each with c in [0, 1] and v, x non-negative"
)


class _Bounds:
    """Interval analysis of a specialized update: a `_Range` for every value.

    Hyperparameters take their declared ranges, `step` is >= 1, nonneg states
    are >= 0, everything else per-element is unbounded.  A product is split
    into its factors so that `c * g * g` is seen as `c * g²` (g² >= 0), and the
    moving averages of `PROVEN_FORMS` are recognised (`_weighted_floor`).

    What is proven is: every value that is not NaN is >= the lower bound.  A
    nonneg state may hold NaN (inf - inf in `v + c * (x - v)`, say), as any state
    may, and a NaN is not made worse by the unsigned int8 map.  Where NaN meets
    min, max or clamp, the kernels and the reference give NaN (docs/LANGUAGE.md
    8.1); the bounds also cover the other operand, so they would stay sound
    for a spelling that returned it.  The bounds are those of exact arithmetic on
    the rounded inputs; fp32 rounding keeps a value >= 0 wherever the proof is
    by signs (squares, sums and products of non-negative values) and can take a
    moving average below 0 by at most an ulp of its inputs, far below an int8
    code's step, where the unsigned map then stores 0.
    """

    def __init__(self, spec: ir.Spec, flags: dict[str, bool]) -> None:
        self.flags = flags
        self.notes: list[str] = []
        self.memo: dict[int, _Range] = {}  # id(expr) -> its range, until the next assignment
        self.env: dict[str, _Range] = {"step": _Range(1.0, _INF, integer=True)}
        for h in spec.hypers:
            iv = h.interval
            self.env[h.name] = _Range(iv.low, iv.high, lo_open=not iv.low_closed, hi_open=not iv.high_closed)
        for s in spec.states:
            self.env[s.name] = _Range(0.0, _INF, True) if s.nonneg else _ANY
        for s in spec.scalars:
            self.env[s.name] = _ANY
        self.env["param"] = self.env["grad"] = _ANY

    def assign(self, name: str, r: _Range) -> None:
        self.env[name] = r
        self.memo.clear()

    def of(self, e: ir.Expr) -> _Range:
        known = self.memo.get(id(e))
        if known is not None:
            return known
        try:
            r = self._of(e)
        except (OverflowError, ValueError, ZeroDivisionError):  # pragma: no cover - bounds are guarded
            r = _ANY
        self.memo[id(e)] = r
        return r

    def _of(self, e: ir.Expr) -> _Range:
        if isinstance(e, ir.Num):
            return _Range(e.value, e.value)
        if isinstance(e, (ir.BoolLit, ir.Given)):
            return _UNIT
        if isinstance(e, ir.Name):
            return self.env.get(e.id, _ANY)
        if isinstance(e, ir.Unary):
            return _neg(self.of(e.operand)) if e.op == "neg" else _UNIT
        if isinstance(e, ir.Binary):
            if e.op == "mul":
                return self._product(_factors(e))
            if e.op in ("add", "sub"):
                a, b = self.of(e.left), self.of(e.right)
                r = _add(a, b if e.op == "add" else _neg(b))
                if r.lo < 0 and self._weighted_floor(e):
                    r = _Range(0.0, max(r.hi, 0.0), r.nan)
                return r
            if e.op == "div":
                return self._quotient(self.of(e.left), self.of(e.right))
            if e.op == "pow":
                return self._power(e)
            return _UNIT  # comparisons and logic
        if isinstance(e, ir.Call):
            return self._call(e)
        return _ANY

    def _quotient(self, a: _Range, b: _Range) -> _Range:
        # A divisor of one sign: its values may still round to a zero of that sign in fp32 (a host value the
        # kernels read, docs/LANGUAGE.md 6) where they reach _FP32_ZERO, hence a reciprocal up to inf there.
        if b.lo > 0 or (b.lo == 0 and b.lo_open):
            recip = _Range(1.0 / b.hi if b.hi != _INF else 0.0, 1.0 / b.lo if b.lo > _FP32_ZERO else _INF)
        elif b.hi < 0 or (b.hi == 0 and b.hi_open):
            recip = _Range(1.0 / b.hi if b.hi < -_FP32_ZERO else -_INF, 1.0 / b.lo if b.lo != -_INF else 0.0)
        else:
            recip = None
        if recip is not None:
            r = _mul(a, recip)
            inf_by_inf = math.isinf(max(-a.lo, a.hi)) and math.isinf(max(-b.lo, b.hi))
            return _Range(r.lo, r.hi, a.nan or b.nan or inf_by_inf)
        return _ANY  # x / 0 is inf of either sign (0 may be -0.0), 0 / 0 is NaN

    def _power(self, e: ir.Binary) -> _Range:
        a, b = self.of(e.left), self.of(e.right)
        k = _const_value(e.right)
        nan = a.nan or b.nan or a.lo < 0
        if k == 0:
            return _Range(1.0, 1.0)
        if k is not None and float(k).is_integer() and k % 2 == 0:  # an even power: x ** 2, x ** -2
            return _Range(0.0, _INF, a.nan)
        m = max(-a.lo, a.hi)
        if not (a.nan or b.nan) and b.lo >= 1 and m <= 1 and (a.lo >= 0 or b.integer):
            # beta ** step: |x| <= 1 and y >= 1 (an integer where x may be negative) give |x ** y| <= |x|, and
            # pow rounds it to at most |x| (a float), so an upper end x does not reach, x ** y does not reach
            # either: the bias correction 1 - beta2 ** step is in (0, 1] for beta2 in [0, 1).
            return _Range(0.0, a.hi, hi_open=a.hi_open) if a.lo >= 0 else _Range(-m, m)
        if a.lo > 0 or (a.lo >= 0 and b.lo >= 0):  # (-0.0) ** -1 is -inf, hence a.lo > 0 for b < 0
            return _Range(0.0, _INF, nan)
        return _ANY

    def _call(self, e: ir.Call) -> _Range:
        f = e.func
        if f == "where":
            try:
                taken = eval_static(e.args[0], self.flags)
            except (AssertionError, KeyError):
                taken = None
            if taken is True:
                return self.of(e.args[1])
            if taken is False:
                return self.of(e.args[2])
            return self.of(e.args[1]).union(self.of(e.args[2]))
        args = [self.of(x) for x in e.args]
        if f == "min" and len(args) == 2:
            return _min(*args)
        if f == "max" and len(args) == 2:
            return _max(*args)
        if f == "clamp" and len(args) == 3:  # min(max(x, lo), hi), also when lo > hi (then every value is hi)
            return _min(_max(args[0], args[1]), args[2])
        if len(args) != 1:
            if f == "atan2" and len(args) == 2:
                return _Range(-math.pi, math.pi, args[0].nan or args[1].nan)
            return _ANY
        a = args[0]
        if f == "sqrt":
            if a.hi < 0:
                return _Range(0.0, 0.0, True)  # every value is NaN
            return _Range(math.sqrt(max(a.lo, 0.0)), math.sqrt(a.hi), a.nan or a.lo < 0)
        if f == "rsqrt":
            if a.lo > 0:  # rsqrt(-0.0) is -inf, so 0 may not be in the range
                return _Range(1.0 / math.sqrt(a.hi), 1.0 / math.sqrt(a.lo), a.nan)
            return _ANY
        if f == "exp":
            return _monotone(math.exp, a, 0.0, _INF)
        if f == "log":
            lo = math.log(a.lo) if a.lo > 0 else -_INF
            hi = math.log(a.hi) if a.hi > 0 else -_INF
            return _Range(lo, hi, a.nan or a.lo < 0)
        if f == "abs":
            lo = 0.0 if a.has(0) else min(abs(a.lo), abs(a.hi))
            return _Range(lo, max(abs(a.lo), abs(a.hi)), a.nan)
        if f == "sign":  # sign(NaN) is NaN (torch) or 0
            lo = -1.0 if a.lo < 0 else (0.0 if a.lo == 0 or a.nan else 1.0)
            hi = 1.0 if a.hi > 0 else (0.0 if a.hi == 0 or a.nan else -1.0)
            return _Range(lo, hi, a.nan)
        if f == "tanh" or f == "erf":
            return _monotone(math.tanh if f == "tanh" else math.erf, a, -1.0, 1.0)
        if f == "atan":
            return _monotone(math.atan, a, -math.pi / 2, math.pi / 2)
        if f == "expm1":
            return _monotone(math.expm1, a, -1.0, _INF)
        if f == "log1p":
            lo = math.log1p(a.lo) if a.lo > -1 else -_INF
            hi = math.log1p(a.hi) if a.hi > -1 else -_INF
            return _Range(lo, hi, a.nan or a.lo < -1)
        return _ANY

    def _product(self, factors: list[ir.Expr]) -> _Range:
        result = _Range(1.0, 1.0)
        remaining = list(factors)
        while remaining:
            f = remaining.pop(0)
            twin = next((i for i, g in enumerate(remaining) if g == f), None)
            if twin is not None:  # f * f >= 0
                remaining.pop(twin)
                r = self.of(f)
                hi = max(_times(r.lo, r.lo), _times(r.hi, r.hi))
                lo = 0.0 if r.has(0) else min(_times(r.lo, r.lo), _times(r.hi, r.hi))
                result = _mul(result, _Range(lo, hi, r.nan))
            else:
                result = _mul(result, self.of(f))
        return result

    def _weighted_floor(self, e: ir.Binary) -> bool:
        """Whether `e` is one of the moving averages of `PROVEN_FORMS`, hence >= 0.

        `v + P` or `P + v` where the factors of P are (x - v) and weights whose product
        is in [0, 1]; `v - P` with (v - x); Yogi's `v - P` with sign(v - x) and x's own
        factors (`v + P` with sign(x - v)).  With v, x >= 0 each is a mix of v and x (or
        moves v towards 0 by less than x when v > x).  The two reads of v are one value:
        the lowering computes equal subexpressions once.
        """
        terms = [(e.left, e.right)] if e.op == "sub" else [(e.left, e.right), (e.right, e.left)]
        for v, p in terms:
            factors = _factors(p)
            for i, f in enumerate(factors):
                rest = factors[:i] + factors[i + 1:]
                x = None
                if isinstance(f, ir.Binary) and f.op == "sub":
                    # v + c * (x - v) ; v - c * (v - x)
                    if e.op == "add" and f.right == v:
                        x = f.left
                    elif e.op == "sub" and f.left == v:
                        x = f.right
                elif isinstance(f, ir.Call) and f.func == "sign" and len(f.args) == 1:
                    d = f.args[0]
                    if isinstance(d, ir.Binary) and d.op == "sub":
                        # v - c * sign(v - x) * x ; v + c * sign(x - v) * x
                        if e.op == "sub" and d.left == v:
                            x = d.right
                        elif e.op == "add" and d.right == v:
                            x = d.left
                        if x is not None:
                            rest = _remove(rest, _factors(x))
                            if rest is None:
                                continue
                if x is None:
                    continue
                weight = self._product(rest)
                form = print_expr(e)
                rv, rx = self.of(v), self.of(x)
                if rv.lo < 0 or rx.lo < 0:
                    side, r = (print_expr(v), rv) if rv.lo < 0 else (print_expr(x), rx)
                    self.notes.append(
                        f"'{form}' is a moving average, non-negative when its two ends are; "
                        f"'{side}' can be negative (its lower bound is {ir.format_number(r.lo)})"
                    )
                    continue
                if weight.lo < 0 or weight.hi > 1:
                    what = " * ".join(print_expr(w) for w in rest) or "1"
                    self.notes.append(
                        f"'{form}' is a moving average, non-negative when its weight is in [0, 1]; "
                        f"'{what}' is in [{ir.format_number(weight.lo)}, {ir.format_number(weight.hi)}]"
                    )
                    continue
                return True
        return False
