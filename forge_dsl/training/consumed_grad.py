"""The `.grad` of a fused weight after its update: a placeholder that makes every use of it say why.

FORGE applies a fused Linear weight's update inside backward and never stores its gradient. Code that
reads `.grad` afterwards, however it was imported, would otherwise see None and go on without it:
`clip_grad_norm_` would clip by the norm of the other gradients, silently. So after the update the
weight's `.grad` is a `ConsumedGrad`, a tensor of the weight's shape and dtype that holds no memory
(`torch.Tensor._make_wrapper_subclass`), and whose every operation is decided here
(`__torch_dispatch__`):

  * what is computed from it (a norm, `abs`, `max`, a copy) is an `Unknown` of the result's shape: its
    value cannot be known, and `.item()` / `float()` give NaN;
  * the clip coefficient of an infinite `max_norm` (`max_norm / (total_norm + eps)`, clamped to 1:
    what Hugging Face Trainer computes to log `grad_norm`) is exactly 1, whatever the norm, so it scales
    nothing: torch's `clip_grad_norm_(params, inf)` returns a NaN norm and leaves every gradient as it was;
  * a finite `max_norm`'s coefficient would need the norm: computing it raises (`CLIP_MESSAGE`) before
    any gradient is scaled, and so does a decision on an unknown value (`if total_norm > 1:`, the
    `error_if_nonfinite` check);
  * in place: `zero_()` (`zero_grad(set_to_none=False)`) and scaling by the coefficient 1 above do
    nothing (a coefficient computed from other gradients alone is refused, even where it is 1: the clipping
    decision left the fused weights out); clamping raises `VALUE_CLIP_MESSAGE`; adding to it (a gradient from another use of the
    weight, accumulation) raises `OUTSIDE_USE_MESSAGE`; anything else raises.

`ForgeOptimizer.step()` steps no parameter whose `.grad` is a `ConsumedGrad`; `zero_grad()` clears it.
"""

from __future__ import annotations

import math

import torch
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["ConsumedGrad", "Unknown", "consumed_grad", "CLIP_MESSAGE", "VALUE_CLIP_MESSAGE", "OUTSIDE_USE_MESSAGE"]

CLIP_MESSAGE = (
    "global-norm gradient clipping needs every gradient before any weight is updated, but FORGE updates "
    "linear weights inside backward without ever storing their gradients, so the norm cannot be taken "
    "exactly (doing it would need a second backward pass). Train without clipping: torch users drop "
    "clip_grad_norm_; Hugging Face Trainer users set TrainingArguments(max_grad_norm=0)."
)
VALUE_CLIP_MESSAGE = (
    "FORGE updates linear weights inside backward without ever storing their gradients, so there is "
    "nothing to clamp afterwards. Clamp inside the update instead: a spec can say "
    "`g = clamp(grad, -clip, clip)` (docs/LANGUAGE.md), which the fused kernel applies exactly."
)
OUTSIDE_USE_MESSAGE = (
    "it was updated inside backward by its nn.Linear, but it also received a gradient from a use outside "
    "that module (e.g. F.linear(x, module.weight) or module.weight.T elsewhere in forward), or its .grad was "
    "written to: that gradient cannot be added to an update already applied. Use the weight only through its "
    "module, or construct the optimizer with fuse=False."
)

_CLAMPS = ("clamp_", "clamp_min_", "clamp_max_", "clip_", "_foreach_clamp_min_", "_foreach_clamp_max_")
_SCALES = ("mul_", "div_", "_foreach_mul_", "_foreach_div_")


class Unknown(torch.Tensor):
    """A tensor whose values FORGE cannot know, with a shape, dtype and device and no memory.

    kind: "grad" (a fused weight's consumed gradient), "value" (computed from one), "reciprocal" (the
    reciprocal of such a value, the first half of `max_norm / norm`), "inf" (that quotient for an infinite
    max_norm), "one" (the clamped clip coefficient of an infinite max_norm: exactly 1)."""

    kind: str
    param_name: str

    @staticmethod
    def __new__(cls, shape, dtype, device, kind: str, name: str):
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)
        t.kind = kind
        t.param_name = name
        return t

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.kind} of {self.param_name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        ours = [a for a in flat if isinstance(a, Unknown)]
        kinds = {a.kind for a in ours}
        first = ours[0]
        op = func.overloadpacket.__name__
        if func is torch.ops.aten._local_scalar_dense.default or op == "is_nonzero":
            if first.dtype != torch.bool:  # .item(), float(): the value is unknown
                return math.nan
            # `if total_norm > max_norm:`, `if total_norm.isnan():` decide on an unknown value
            raise RuntimeError(f"a decision on a value computed from the gradient of '{first.param_name}': "
                               + CLIP_MESSAGE)
        if op.endswith("_") or "out" in kwargs:
            return _in_place(op, args, ours, kinds)
        if op == "mul" and kinds == {"reciprocal"}:  # max_norm / value: a clip coefficient
            scalars = [float(a) for a in flat if not isinstance(a, Unknown) and _is_scalar(a)]
            if scalars and all(v == math.inf for v in scalars):
                return Unknown((), first.dtype, first.device, "inf", first.param_name)
            raise RuntimeError(f"clip_grad_norm_ cannot see the gradient of the FORGE-fused weight '{first.param_name}': "
                               + CLIP_MESSAGE)
        if op in ("clamp", "clamp_max") and kinds == {"inf"}:  # min(inf, 1): the coefficient 1
            return Unknown((), first.dtype, first.device, "one", first.param_name)
        if op == "_to_copy" and kinds <= {"inf", "one"}:
            return Unknown((), kwargs.get("dtype") or first.dtype, kwargs.get("device") or first.device, first.kind,
                       first.param_name)
        if "grad" in kinds and any(isinstance(a, torch.Tensor) and not isinstance(a, Unknown) and a.dim() > 0
                                   for a in flat):
            raise RuntimeError(f"'{first.param_name}': " + OUTSIDE_USE_MESSAGE)
        # anything else: the result's metadata from meta tensors, its values unknown
        meta = tree_map(lambda a: torch.empty(a.shape, dtype=a.dtype, device="meta")
                        if isinstance(a, torch.Tensor) else a, (args, kwargs))
        out = func(*meta[0], **meta[1])
        kind = "reciprocal" if op == "reciprocal" and kinds == {"value"} else "value"
        return tree_map(lambda o: Unknown(o.shape, o.dtype, first.device, kind, first.param_name)
                        if isinstance(o, torch.Tensor) else o, out)


def _is_scalar(a) -> bool:
    return isinstance(a, (int, float)) or (isinstance(a, torch.Tensor) and a.numel() == 1 and a.device.type != "meta")


def _in_place(op: str, args, ours: list, kinds: set):
    """An in-place operation that involves an Unknown (see the module docstring)."""
    target = args[0]
    first = ours[0]
    targets = target if isinstance(target, (list, tuple)) else [target]
    if op == "zero_" and isinstance(target, Unknown):
        return target
    if op in _SCALES and kinds <= {"one", "grad"} and "one" in kinds:
        return target  # scaled by an infinite max_norm's coefficient, exactly 1: nothing to do
    if op in _CLAMPS:
        raise RuntimeError(f"clip_grad_value_ cannot clamp the gradient of the FORGE-fused weight '{first.param_name}': "
                           + VALUE_CLIP_MESSAGE)
    if op in _SCALES:
        raise RuntimeError(f"clipping cannot scale the gradient of the FORGE-fused weight '{first.param_name}', and the "
                           "total norm never saw it: " + CLIP_MESSAGE)
    if any(isinstance(t, Unknown) and t.kind == "grad" for t in targets):
        raise RuntimeError(f"'{first.param_name}': " + OUTSIDE_USE_MESSAGE)
    raise RuntimeError(f"a value computed from the gradient of the FORGE-fused weight '{first.param_name}', which FORGE "
                       f"applied inside backward and never stored, cannot be written into a tensor ({op})")


class ConsumedGrad(Unknown):
    """The `.grad` of a fused weight whose update was applied inside backward (see the module docstring)."""


def consumed_grad(weight: torch.Tensor, name: str) -> ConsumedGrad:
    """The placeholder `.grad` of `weight` [N, K], updated inside backward (`name`: its parameter's name)."""
    return ConsumedGrad(weight.shape, weight.dtype, weight.device, "grad", name)
