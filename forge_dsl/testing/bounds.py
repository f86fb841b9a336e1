"""How far a kernel's result may be from the float64 reference step, per layout.

Each bound follows from what the kernel rounds (tests/test_kernels.py's module docstring):
  * fp32 weights and fp32 state: only fp32 arithmetic differs; relative error (‖a − b‖ / ‖b‖) at most
    `FP32_REL_TOL` over several steps without re-synchronising (`rel_err`).
  * quantized layouts and bf16 weights: one step at a time from the kernel's own previous (dequantized)
    values, element by element: the kernel computes the update in fp32 registers and rounds once on
    store, so each element is within the layout's rounding bound of the exact value plus fp32 slack
    (`bound`, `weight_bound`).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..layouts import StateLayout, as_rows, dequantize, n_blocks

__all__ = ["FP32_REL_TOL", "FP32_SLACK", "rel_err", "layout_code", "as_float64_state", "bf16_ulp", "block_scale",
           "bound", "weight_bound", "sign_tie_allowance"]

FP32_REL_TOL = 1e-5  # fp32 weights and state: relative error after several steps
FP32_SLACK = 2e-5  # relative fp32 arithmetic allowance per element (dW over T tokens, then the update)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64 on the CPU (b's norm floored at 1e-30)."""
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def layout_code(t: torch.Tensor) -> StateLayout:
    """The layout a state tensor is stored in, from its dtype."""
    return {torch.float32: StateLayout.FP32, torch.bfloat16: StateLayout.BF16, torch.int8: StateLayout.INT8,
            torch.uint8: StateLayout.UINT8_SQRT}[t.dtype]


def as_float64_state(state: dict, spec) -> dict:
    """The values a kernel's `state` holds (int8 codes dequantized with their scales), as float64 CPU tensors
    shaped like the parameter, plus the scalar states (cloned): what `reference_step` runs on."""
    out = {}
    for s in spec.states:
        if s.name in state:
            t = state[s.name]
            scale = state.get(f"{s.name}.scale")
            out[s.name] = dequantize(t.cpu(), None if scale is None else scale.cpu(), layout_code(t)).double()
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


def bound(layout: StateLayout, ref: torch.Tensor, stored_scale_of: torch.Tensor) -> torch.Tensor:
    """Per-element bound on |stored − exact| for one rounding into `layout`.

    ref: the exact (float64) values; stored_scale_of: the tensor whose 64-element block maxima are the
    stored int8 scales (the kernel's dequantized result for INT8 / UINT8_SQRT; unused otherwise).
    """
    # fp32 arithmetic: relative to the element, plus a floor relative to the tensor (dW elements that
    # cancel over the T tokens carry an absolute error of about sqrt(T)·u·max|dW|).
    slack = FP32_SLACK * ref.abs() + 1e-5 * ref.abs().max()
    if layout == StateLayout.FP32:
        return slack
    if layout == StateLayout.BF16:
        return 0.5 * bf16_ulp(ref) + slack
    scale = block_scale(stored_scale_of)
    if layout == StateLayout.INT8:
        return scale / 254 * (1 + 1e-5) + slack
    # UINT8_SQRT: half the gap between the codes around x, plus scale / (4 * 255**2)
    u = torch.sqrt(ref.clamp_min(0) / scale.clamp_min(1e-30)) * 255
    gap = scale * ((u.floor() + 1) ** 2 - u.floor() ** 2) / 255**2
    return 0.5 * gap + scale / (4 * 255**2) * (1 + 1e-5) + slack


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
    from ..checker import combinations
    from ..lowering import lower

    return any(i.op == "sign" for combo in combinations(spec) for i in lower(spec, combo).elem)
