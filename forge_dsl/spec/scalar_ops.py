"""What each operation of the language means on plain Python floats (IEEE float64).

Used for constant folding (lowering), the host-scalar program (reference step,
generated host code) and derived flags.  Domain errors give NaN or inf as in
IEEE arithmetic, never a Python exception.
"""

from __future__ import annotations

import math
import struct

__all__ = ["apply_scalar_op", "fp32"]

_FP32 = struct.Struct("f")


def fp32(x: float) -> float:
    """`x` rounded once to the nearest fp32 (ties to even), as a Python float: what a host value becomes where
    the per-element program reads it (docs/LANGUAGE.md, section 6), as torch rounds a Python float that meets an
    fp32 tensor. Beyond fp32's range, a signed inf; below half its smallest subnormal, a signed 0; NaN stays."""
    try:
        return _FP32.unpack(_FP32.pack(x))[0]
    except OverflowError:  # struct refuses what rounds to inf
        return math.copysign(math.inf, x)


def _div(a: float, b: float) -> float:
    if b == 0.0:
        if a == 0.0 or math.isnan(a):
            return math.nan
        return math.copysign(math.inf, a) * math.copysign(1.0, b)
    return a / b


def _is_odd_integer(b: float) -> bool:
    return math.isfinite(b) and b == math.floor(b) and math.fmod(b, 2.0) != 0.0


def _pow(a: float, b: float) -> float:
    """`a ** b` as torch.pow in float64 (C99 pow): pow(x, 0) = 1 and pow(1, y) = 1 even for NaN; a
    negative base with an integer exponent has the sign of its parity, with any other exponent NaN;
    0 ** negative = inf (with the sign of the zero for an odd exponent); overflow is inf, signed."""
    try:
        r = a**b
    except OverflowError:
        if a < 0 and b != math.floor(b):  # negative ** fractional
            return math.nan
        return -math.inf if a < 0 and _is_odd_integer(b) else math.inf
    except ZeroDivisionError:  # (+-0) ** negative
        return math.copysign(math.inf, a) if _is_odd_integer(b) else math.inf
    if isinstance(r, complex):  # negative ** fractional
        return math.nan
    return float(r)


def _sqrt(a: float) -> float:
    return math.sqrt(a) if a >= 0 else math.nan


def _rsqrt(a: float) -> float:
    if a == 0:
        return math.copysign(math.inf, a)
    return 1.0 / math.sqrt(a) if a > 0 else math.nan


def _log(a: float) -> float:
    if a == 0:
        return -math.inf
    return math.log(a) if a > 0 else math.nan


def _exp(a: float) -> float:
    try:
        return math.exp(a)
    except OverflowError:
        return math.inf


def _log1p(a: float) -> float:
    if a == -1:
        return -math.inf
    return math.log1p(a) if a > -1 else math.nan  # NaN for NaN too


def _expm1(a: float) -> float:
    try:
        return math.expm1(a)
    except OverflowError:
        return math.inf


def _sign(a: float) -> float:
    if math.isnan(a):
        return math.nan
    return 1.0 if a > 0 else (-1.0 if a < 0 else a)  # +-0 keeps its sign


def _min(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b):
        return math.nan
    return min(a, b)


def _max(a: float, b: float) -> float:
    if math.isnan(a) or math.isnan(b):
        return math.nan
    return max(a, b)


def _mul(a: float, b: float) -> float:
    return a * b


_OPS = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": _mul,
    "div": _div,
    "pow": _pow,
    "neg": lambda a: -a,
    "sqrt": _sqrt,
    "rsqrt": _rsqrt,
    "abs": abs,
    "sign": _sign,
    "exp": _exp,
    "log": _log,
    "atan": math.atan,
    "atan2": math.atan2,
    "tanh": math.tanh,
    "erf": math.erf,
    "log1p": _log1p,
    "expm1": _expm1,
    "min": _min,
    "max": _max,
    "clamp": lambda x, lo, hi: _min(_max(x, lo), hi),
    "where": lambda c, a, b: a if c else b,
    "lt": lambda a, b: a < b,
    "le": lambda a, b: a <= b,
    "gt": lambda a, b: a > b,
    "ge": lambda a, b: a >= b,
    "eq": lambda a, b: a == b,
    "ne": lambda a, b: a != b,
    "and": lambda a, b: bool(a) and bool(b),
    "or": lambda a, b: bool(a) or bool(b),
    "not": lambda a: not a,
}


def apply_scalar_op(op: str, *args):
    """`op` applied to Python floats/bools, with IEEE results for domain errors."""
    try:
        return _OPS[op](*args)
    except OverflowError:
        return math.inf
