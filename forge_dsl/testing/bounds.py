"""How far a kernel's result may be from the float64 reference step, per layout.

Each bound follows from what the kernel rounds (tests/kernels/test_kernels.py's module docstring):
  * fp32 weights and fp32 state: only fp32 arithmetic differs; relative error (‖a − b‖ / ‖b‖) at most
    `FP32_REL_TOL` over several steps without re-synchronising (`rel_err`).
  * quantized layouts and bf16 weights: one step at a time from the kernel's own previous (dequantized)
    values, element by element: the kernel computes the update in fp32 registers and rounds once on
    store, so each element is within the layout's rounding bound of the exact value plus fp32 slack
    (`bound`, `weight_bound`).
  * the update, every weight dtype: a per-element bound on the kernel's step against the reference's step
    from the same weight, far tighter than the weight's own (`update_slack`, `update_bound`), and for
    stochastic rounding the mean rounding error along the update (`sr_mean_bound`). The weight bounds
    above are relative to the weight; a step moves it by a few percent, so an error of 0.1 % in the
    update hides inside them.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..kernels.layouts import FOUR_BIT_LAYOUTS, INT4_MAP, StateLayout, as_rows, dequantize, layout_of, n_blocks

__all__ = ["FP32_REL_TOL", "FP32_SLACK", "UPDATE_ULPS", "UPDATE_REL", "UPDATE_FLOOR", "SR_SIGMAS", "rel_err",
           "layout_code", "as_float64_state", "bf16_ulp", "fp32_ulp", "block_scale", "bound", "weight_bound",
           "dw_error_bound", "update_slack", "update_bound", "RoundingMean", "sr_mean_bound",
           "sign_tie_allowance"]

FP32_REL_TOL = 1e-5  # fp32 weights and state: relative error after several steps
FP32_SLACK = 2e-5  # relative fp32 arithmetic allowance per element (dW over T tokens, then the update)
# The update's bound (`update_slack`): c1 fp32 ulps of the weight, c2 of the update, a floor c3 of the largest update.
UPDATE_ULPS = 4.0
UPDATE_REL = 2e-5
UPDATE_FLOOR = 1e-6
SR_SIGMAS = 6.0  # stochastic rounding's mean error: standard deviations allowed (`sr_mean_bound`)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64 on the CPU (b's norm floored at 1e-30)."""
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def layout_code(t: torch.Tensor, scale: Optional[torch.Tensor] = None) -> StateLayout:
    """The layout a state tensor is stored in (`forge_dsl.kernels.layouts.layout_of`; pass its block `scale` to tell
    4-bit codes from 8-bit ones)."""
    layout = layout_of(t, scale=scale)
    if layout is None:
        raise ValueError(f"no state layout stores dtype {t.dtype}")
    return layout


def as_float64_state(state: dict, spec) -> dict:
    """The values a kernel's `state` holds (int8 codes dequantized with their scales), as float64 CPU tensors
    shaped like the parameter, plus the scalar states (cloned): what `reference_step` runs on."""
    out = {}
    for s in spec.states:
        if s.name in state:
            t = state[s.name]
            scale = state.get(f"{s.name}.scale")
            out[s.name] = dequantize(t.cpu(), None if scale is None else scale.cpu(), layout_code(t, scale)).double()
    for s in spec.scalars:
        out[s.name] = state[s.name].clone()
    return out


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 numbers at |x| (8 significant bits)."""
    mag = x.abs().clamp_min(2.0**-126)
    return torch.exp2(torch.floor(torch.log2(mag)) - 7)


def block_scale(x: torch.Tensor) -> torch.Tensor:
    """max |x| over each 64-wide block of each row, broadcast back per element."""
    x2 = as_rows(x)
    rows, cols = x2.shape
    nb = n_blocks(cols)
    pad = torch.nn.functional.pad(x2.abs(), (0, nb * 64 - cols)).reshape(rows, nb, 64).amax(-1)
    return pad.repeat_interleave(64, dim=1)[:, :cols].reshape(x.shape)


def bound(layout: StateLayout, ref: torch.Tensor, stored_scale_of: torch.Tensor,
          scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-element bound on |stored − exact| for one rounding into `layout`.

    ref: the exact (float64) values; stored_scale_of: the tensor whose 64-element block maxima are the
    stored int8 scales (the kernel's dequantized result for INT8 / UINT8_SQRT; unused otherwise, and where
    `scale` is given).
    scale: the stored block scales `[rows, n_blocks]` themselves (float32 or bfloat16), which the 4-bit
    layouts need (INT4's map has no -1, so a dequantized block's maximum is not its scale); the 8-bit
    layouts read them too where given. A bf16 scale is the block maximum rounded up, by a factor of at
    most 1 + 2**-7 (1 + 2**-8 on average): the bounds, relative to the stored scale, grow by that much.
    """
    # fp32 arithmetic: relative to the element, plus a floor relative to the tensor (dW elements that
    # cancel over the T tokens carry an absolute error of about sqrt(T)·u·max|dW|).
    slack = FP32_SLACK * ref.abs() + 1e-5 * ref.abs().max()
    if layout == StateLayout.FP32:
        return slack
    if layout == StateLayout.BF16:
        return 0.5 * bf16_ulp(ref) + slack
    if layout in FOUR_BIT_LAYOUTS:
        if scale is None:
            raise ValueError(f"bound of {layout.name} state needs its stored block scales (scale=...)")
        return _four_bit_bound(layout, ref, scale) + 2 * slack
    scale = block_scale(stored_scale_of) if scale is None else _per_element(scale, ref)
    if layout == StateLayout.INT8:
        return scale / 254 * (1 + 1e-5) + slack
    # UINT8_SQRT: half the gap between the codes around x, plus scale / (4 * 255**2)
    u = torch.sqrt(ref.clamp_min(0) / scale.clamp_min(1e-30)) * 255
    gap = scale * ((u.floor() + 1) ** 2 - u.floor() ** 2) / 255**2
    return 0.5 * gap + scale / (4 * 255**2) * (1 + 1e-5) + slack


def _per_element(scale: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Block scales `[rows, n_blocks]` → float64 per element of `ref` (on ref's device)."""
    rows, cols = as_rows(ref).shape
    s = scale.to(device=ref.device, dtype=torch.float64).repeat_interleave(64, dim=1)[:, :cols]
    return s.reshape(ref.shape)


def _four_bit_bound(layout: StateLayout, ref: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """scale × the distance from ref / scale to the nearest map value, per element (INT4: `INT4_MAP`; UINT4:
    (q + 1) / 16), plus 4 fp32 ulps of the scale; where the state went negative (UINT4 stores it as 0), that
    much more. The kernel rounds its fp32 value v, within the slack of ref, to v's nearest map value, which is
    within dist(ref) + |v − ref| of v and so dist(ref) + 2 |v − ref| of ref: `bound` adds the slack twice."""
    ref = ref.double().cpu()
    r2 = as_rows(ref)
    rows, cols = r2.shape
    s = scale.double().cpu().repeat_interleave(64, dim=1)[:, :cols]  # [rows, cols]
    if layout == StateLayout.INT4:
        points = INT4_MAP.double()
        t = r2
    else:
        points = torch.arange(1, 17, dtype=torch.float64) / 16
        t = r2.clamp_min(0)
    ok = (s > 0) & torch.isfinite(s)
    u = torch.where(ok, t / torch.where(ok, s, torch.ones_like(s)), torch.zeros_like(t))
    dist = (u[..., None] - points).abs().amin(-1)
    out = s * dist + 4 * s * 2.0**-24 + (r2 - t).abs()
    out = torch.where(ok, out, torch.where(torch.isfinite(s), s, torch.zeros_like(s)))  # blocks stored as 0 / s / 16
    return out.reshape(ref.shape)


def weight_bound(ref_w: torch.Tensor, w_dtype: torch.dtype, rounding: str = "stochastic") -> torch.Tensor:
    """Per-element bound on |stored − exact| for one step's weight, `ref_w` the exact float64 result.

    fp32 weights: fp32 slack only. bf16 weights: stochastic rounding lands on one of the two bf16
    neighbours of the exact value (an ulp); nearest rounding within half an ulp (`bound`'s BF16).
    """
    if w_dtype == torch.float32:
        return bound(StateLayout.FP32, ref_w, ref_w)
    if rounding == "nearest":
        return bound(StateLayout.BF16, ref_w, ref_w)
    return bf16_ulp(ref_w) * (1 + 1e-3) + FP32_SLACK * ref_w.abs() + 1e-5 * ref_w.abs().max()


def fp32_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of fp32 numbers at |x| (24 significant bits; that of 2^-126 below it)."""
    mag = x.abs().clamp_min(2.0**-126)
    return torch.exp2(torch.floor(torch.log2(mag)) - 23)


def dw_error_bound(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """|fp32 dW − dyᵀx| per element, [N, K] float64 on the CPU, for dy [T, N] and x [T, K] (fp32 or bf16).

    A T-term dot product in fp32, in any order, with or without FMA, is within γ_T · Σ_t |dy_tn| |x_tk|
    of the exact one, γ_T = T·u / (1 − T·u), u = 2^-24 (Higham, Accuracy and Stability of Numerical
    Algorithms, (3.5)); bf16 products are exact in fp32, fp32 ones round once, which γ_T counts.
    """
    t = dy.shape[0]
    gamma = t * 2.0**-24 / (1 - t * 2.0**-24)
    return gamma * (dy.double().cpu().abs().T @ x.double().cpu().abs())


def update_slack(w_before: torch.Tensor, ref_after: torch.Tensor, spread: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-element bound on |Δw_kernel − Δw_ref| in fp32 registers, before the weight's store rounds it; float64.

    w_before: the weight both steps start from; ref_after: the reference's result (float64), so
    Δw_ref = ref_after − w_before. spread: how far Δw_ref moves when the gradient moves within its own
    rounding error (`dw_error_bound`; the fused and slab paths compute dW in fp32), or None (exact).

        UPDATE_ULPS · ulp32(max(|w_before|, |ref_after|)) + UPDATE_REL · |Δw_ref| + UPDATE_FLOOR · max |Δw_ref| + spread

    * c1 = UPDATE_ULPS = 4 fp32 ulps of the weight: the kernel computes the new weight in fp32 from the
      weight: a weight-decay factor (1 − lr·wd), a host value rounded to fp32 (≤ 1 ulp) and a multiply
      (0.5), the subtraction of the update (0.5) and a second term's (NAdam, 0.5), and the fp32 result
      itself (0.5 ulp before the store).
    * c2 = UPDATE_REL = 2e-5 of the update: 10 to 30 fp32 operations each rounding by u = 6e-8, host
      values (bias corrections, lr / (1 − μ-products)) rounded to fp32 once, int8 state dequantized in
      fp32: about 1e-6. A kernel off by 0.1 % is 50× beyond it.
    * c3 = UPDATE_FLOOR = 1e-6 of the largest update: terms of the update's size that cancel (NAdam's
      two momentum terms, g + wd·w): their rounding is u of the terms, not of their difference.
    * `spread`: the update is a function of the gradient element by element, so the reference run at
      dW ± `dw_error_bound` brackets what the kernel's own dW gives (the sensitivity can be large: Adam's
      g / (|g| + ε) at |g| ≈ ε, a `sign()` whose argument the rounding flips).
    How close correct kernels come to it: docs/PERF.md v15.
    """
    w0, ref = w_before.double().cpu(), ref_after.double().cpu()
    d = (ref - w0).abs()
    d = torch.where(torch.isfinite(d), d, torch.zeros_like(d))
    top = d.max() if d.numel() else d.new_zeros(())
    slack = UPDATE_ULPS * fp32_ulp(torch.maximum(w0.abs(), ref.abs())) + UPDATE_REL * d + UPDATE_FLOOR * top
    if spread is not None:
        slack = slack + spread.double().cpu()
    return torch.where(torch.isnan(slack), torch.zeros_like(slack), slack)


def update_bound(w_before: torch.Tensor, ref_after: torch.Tensor, w_dtype: torch.dtype, rounding: str = "stochastic",
                 spread: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-element bound on |w_kernel − ref_after| after one step from `w_before` (float64, the weight's shape).

    fp32 weights: `update_slack`. bf16 weights: the kernel rounds its fp32 result v, within `update_slack`
    of the exact one, once: nearest within half the bf16 spacing at v, stochastic to one of v's two
    bf16 neighbours (less than one spacing); the spacing at |v| ≤ |ref_after| + slack.
    """
    slack = update_slack(w_before, ref_after, spread)
    if w_dtype == torch.float32:
        return slack
    gap = bf16_ulp(ref_after.double().cpu().abs() + slack)
    return (0.5 if rounding == "nearest" else 1.0) * gap + slack


class RoundingMean:
    """Stochastic rounding's mean error along the update, pooled over the elements and steps of a case.

    For each element with Δw_ref ≠ 0: d = sign(Δw_ref) · (w_kernel − ref_after) / ulp_bf16(ref_after).
    The kernel adds 16 uniform random bits to its fp32 result v and truncates, so E[w_kernel] = v
    exactly, and w_kernel − v spans one bf16 gap g (at |v|): each d has mean within s = slack / ulp of 0
    (v is within `update_slack` of ref_after) and variance ≤ (g / ulp)² / 4 (≈ 1/4). The bits are
    new per element and step (`kernel_calls.mix_seed`), so over n elements

        |mean d| ≤ SR_SIGMAS · sqrt(Σ (g/ulp)² / 4) / n + Σ s / n   (≈ 3 / sqrt(n))

    fails a correct kernel with probability about 2e-9 (6 σ). An update systematically off by a
    fraction ε shifts mean d by ε · mean(|Δw_ref| / ulp): the per-element bounds cannot see it below
    an ulp, this mean can once n is large.
    """

    def __init__(self):
        self.sum_d, self.sum_var, self.sum_sys, self.n = 0.0, 0.0, 0.0, 0

    def add(self, w_before: torch.Tensor, ref_after: torch.Tensor, got: torch.Tensor, slack: torch.Tensor,
            keep: Optional[torch.Tensor] = None) -> None:
        """One step's elements (float64 CPU tensors, the weight's shape); `keep`: a mask of those to count
        (elements beyond their bound, excused sign ties, are left out)."""
        ref, got = ref_after.double().cpu(), got.double().cpu()
        s = torch.sign(ref - w_before.double().cpu())
        use = torch.isfinite(ref) & torch.isfinite(got) & (s != 0)
        if keep is not None:
            use &= keep
        ulp = bf16_ulp(ref)
        gap = bf16_ulp(ref.abs() + slack)
        self.sum_d += float((s * (got - ref) / ulp)[use].sum())
        self.sum_var += float(((gap / ulp) ** 2 / 4)[use].sum())
        self.sum_sys += float((slack / ulp)[use].sum())
        self.n += int(use.sum())

    @property
    def statistic(self) -> float:
        """|mean d| (0 with no elements)."""
        return abs(self.sum_d) / self.n if self.n else 0.0

    @property
    def bound(self) -> float:
        return sr_mean_bound(self.n, self.sum_var, self.sum_sys)


def sr_mean_bound(n: int, sum_var: float, sum_sys: float) -> float:
    """`RoundingMean`'s bound on |mean d| over n elements: SR_SIGMAS · sqrt(Σ var) / n + Σ s / n."""
    if n == 0:
        return 0.0
    return SR_SIGMAS * math.sqrt(sum_var) / n + sum_sys / n


def sign_tie_allowance(spec, hypers: dict, x_dtype: torch.dtype, path: str) -> Optional[float]:
    """How far a weight may move beyond its bound where `sign()` of an exact zero decides the update, or None.

    The slab path's bf16 dW can cancel exactly in a sign's argument (Lion's β1·m + (1 − β1)·g, seen on the
    GPU): the sign of that zero is fp32 vs float64 rounding, and an `lr · sign(...)` update flips by 2·lr.
    Such ties are excused, at most one per 1000 weights (`max(2, numel // 1000)`), for specs whose update
    takes a sign and has an `lr`.
    """
    if path != "slab" or x_dtype != torch.bfloat16 or "lr" not in hypers or not _uses_sign(spec):
        return None
    return 2 * float(hypers["lr"]) * (1 + 1e-3)


def _uses_sign(spec) -> bool:
    from ..compiler.lowering import lower
    from ..spec.variants import combinations

    return any(i.op == "sign" for combo in combinations(spec) for i in lower(spec, combo).elem)
