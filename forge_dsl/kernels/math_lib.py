"""The spec language's math functions that Triton lacks (or lacks in the interpreter), on fp32 tiles.

The generated modules import the ones their update calls (`forge_dsl.compiler.codegen.LIB_FUNCTIONS`).
"""

import triton
import triton.language as tl

__all__ = [
    "math_atan",
    "math_atan2",
    "math_erf",
    "math_expm1",
    "math_log1p",
    "math_pow",
    "math_tanh",
]


# ----------------------------------------------------------------------------
# Math functions of the spec language that Triton lacks (or lacks in the interpreter)
# ----------------------------------------------------------------------------
# `triton.language.extra.libdevice` has these, but the interpreter cannot call it, so the kernels
# tested on the CPU would not be the kernels run on the GPU. These are written with operations both
# run: fp32 tiles in, fp32 tiles out, with the special values of torch / C99 (docs/LANGUAGE.md,
# "Numbers"). A two-argument helper also takes a scalar for either argument (a host kernel argument,
# which the interpreter passes as a Python float, or a literal) and broadcasts it first: the 3.9
# interpreter cannot `&` a scalar boolean with a tile. Divisions are `tl.div_rn` (IEEE)
# where a special value or a bound depends on the quotient, and a negation is `r * -1.0`: Triton
# compiles `-r` to `0.0 - r`, which is +0.0 for r = +0.0.


@triton.jit
def _sign_bit(x):
    """True where x's sign bit is set (negative numbers, -0.0, -inf, a negative NaN)."""
    return x.to(tl.int32, bitcast=True) < 0


@triton.jit
def _tiles(a, b):
    """a and b as fp32 tensors of one shape (either may be a scalar or a Python float)."""
    return tl.broadcast(tl.cast(a, tl.float32), tl.cast(b, tl.float32))


@triton.jit
def math_pow(x, y):
    """x ** y for any x, y (torch.pow): pow(x, 0) = 1 and pow(1, y) = 1, NaN included; pow(-1, +-inf)
    = 1; a negative finite base with a non-integer exponent is NaN, with an integer one it is
    |x| ** y with the sign of its parity (-0.0 and -inf included). |x| ** y is exp2(y * log2|x|):
    relative error about |y * log2|x|| * 1e-7."""
    x, y = _tiles(x, y)
    r = tl.exp2(y * tl.log2(tl.abs(x)))
    y_int = tl.floor(y) == y  # +-inf counts as an even integer; NaN as neither
    y_odd = y_int & (tl.floor(y * 0.5) * 2.0 != y)
    r = tl.where(_sign_bit(x) & y_odd, r * -1.0, r)
    r = tl.where((x < 0) & (x != float("-inf")) & (~y_int), float("nan"), r)
    r = tl.where((x == -1.0) & (tl.abs(y) == float("inf")), 1.0, r)
    return tl.where((y == 0) | (x == 1.0), 1.0, r)


@triton.jit
def _atan_unit(t):
    """atan(t) for t in [0, 1] (or NaN): t > tan(pi/8) is reduced by atan(t) = pi/4 + atan((t-1)/(t+1)),
    then Cephes' atanf polynomial on |u| <= tan(pi/8)."""
    big = t > 0.41421356237309503
    u = tl.where(big, tl.div_rn(t - 1.0, t + 1.0), t)
    z = u * u
    p = (((8.05374449538e-2 * z - 1.38776856032e-1) * z + 1.99777106478e-1) * z - 3.33329491539e-1) * z * u + u
    return tl.where(big, 0.7853981633974483 + p, p)


@triton.jit
def math_atan(x):
    """atan(x): odd, atan(+-inf) = +-pi/2, atan(-0.0) = -0.0, NaN for NaN."""
    a = tl.abs(x)
    inv = a > 1.0
    r = _atan_unit(tl.where(inv, tl.div_rn(1.0, a), a))
    r = tl.where(inv, 1.5707963267948966 - r, r)
    return tl.where(x < 0, r * -1.0, tl.where(x == 0, x, r))


@triton.jit
def math_atan2(y, x):
    """atan2(y, x) in [-pi, pi] with C99's special values: the signs of zeros count (atan2(+-0, -0)
    = +-pi), atan2(+-inf, +-inf) = +-pi/4 or +-3pi/4, NaN if either is NaN."""
    y, x = _tiles(y, x)
    ax = tl.abs(x)
    ay = tl.abs(y)
    hi = tl.maximum(ax, ay)
    lo = tl.minimum(ax, ay)
    t = tl.where(hi == 0, 0.0, tl.div_rn(lo, tl.where(hi == 0, 1.0, hi)))
    t = tl.where(lo == float("inf"), 1.0, t)
    r = _atan_unit(t)
    r = tl.where(ay > ax, 1.5707963267948966 - r, r)
    r = tl.where(_sign_bit(x), 3.141592653589793 - r, r)
    r = tl.where((x != x) | (y != y), float("nan"), r)
    return tl.where(_sign_bit(y), r * -1.0, r)


@triton.jit
def math_expm1(x):
    """exp(x) - 1 without cancellation near 0: the Taylor series to x**9 for |x| < 0.5 (truncation below
    1e-9 relative), exp(x) - 1 elsewhere; expm1(-0.0) = -0.0, -1 at -inf, inf on overflow."""
    p = x * (1.0 + x * (0.5 + x * (1.6666666666666666e-1 + x * (4.1666666666666664e-2 + x * (
        8.333333333333333e-3 + x * (1.388888888888889e-3 + x * (1.984126984126984e-4 + x * (
            2.48015873015873e-5 + x * 2.755731922398589e-6))))))))
    return tl.where(tl.abs(x) < 0.5, p, tl.exp(x) - 1.0)


@triton.jit
def math_log1p(x):
    """log(1 + x) without cancellation near 0: 2 atanh(s), s = x / (2 + x), by its odd series to s**11
    for x in (-0.25, 0.375) (|s| < 0.16, truncation below 1e-10 relative), log(1 + x) elsewhere;
    log1p(-0.0) = -0.0, -inf at -1, NaN below -1."""
    s = tl.div_rn(x, x + 2.0)
    z = s * s
    p = 2.0 * s * (1.0 + z * (3.3333333333333333e-1 + z * (0.2 + z * (1.4285714285714285e-1 + z * (
        1.1111111111111111e-1 + z * 9.090909090909091e-2)))))
    return tl.where((x > -0.25) & (x < 0.375), p, tl.log(1.0 + x))


@triton.jit
def math_tanh(x):
    """tanh(x) = e / (e + 2) with e = expm1(2|x|), |x| capped at 10 (tanh(10) is 1 in fp32), the sign
    restored; tanh(-0.0) = -0.0, +-1 at +-inf, NaN for NaN."""
    a = tl.abs(x)
    e = math_expm1(2.0 * tl.where(a > 10.0, 10.0, a))
    r = tl.div_rn(e, e + 2.0)
    return tl.where(x < 0, r * -1.0, tl.where(x == 0, x, r))


@triton.jit
def math_erf(x):
    """erf(x) (Triton's; libdevice's erff when compiled)."""
    return tl.erf(x)
