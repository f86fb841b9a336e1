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

Where the optimizer clips by the global norm itself (`ForgeOptimizer(max_grad_norm=c)`: `optimizer.backward(loss)`,
or gradient accumulation, which keeps the gradient in a buffer), a fused weight's `.grad` is a `ReportingGrad`: its
norm is known (the first pass's sum of squares, or the buffer's), so `clip_grad_norm_` computes the true total
norm, before clipping, and returns it as a `ReportedNorm`, a tensor with that value. Scaling any gradient by a
value computed from a `ReportedNorm` does nothing: the optimizer applies the clipping itself, once, with its own
`max_grad_norm` (`clip_grad_norm_` "no longer needs to clip"); so does any in-place `mul_` / `div_` by such a value
(whatever the tensor: use `float(norm)` to scale something else by it).

`ForgeOptimizer.step()` steps no parameter whose `.grad` is a `ConsumedGrad`; `zero_grad()` clears it (with
`set_to_none=False` it stays, zeroed in place as a no-op; an accumulation placeholder's `on_zero` then drops the
micro-batches it stands for).
"""

from __future__ import annotations

import math

import torch
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["ConsumedGrad", "ReportedNorm", "ReportingGrad", "Unknown", "consumed_grad", "CLIP_MESSAGE", "SHARD_ACCUMULATION_MESSAGE",
           "VALUE_CLIP_MESSAGE", "OUTSIDE_USE_MESSAGE"]

CLIP_MESSAGE = (
    "global-norm gradient clipping needs every gradient before any weight is updated, and a plain "
    "loss.backward() already applied this step's update of the FORGE-fused weights inside backward, unclipped "
    "(their gradients were never stored), so nothing can be clipped now. For exact clipping, construct the "
    "optimizer with ForgeOptimizer(..., max_grad_norm=c) and call optimizer.backward(loss) instead of "
    "loss.backward() (two backward passes: the norm, then the clipped update); Hugging Face Trainer users train "
    "with forge_dsl.ForgeTrainer, which does both. Or construct it with fuse=False (every parameter stepped from "
    ".grad, as torch does, without FORGE's memory saving), or train without clipping "
    "(TrainingArguments(max_grad_norm=0))."
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

SHARD_ACCUMULATION_MESSAGE = (
    "FSDP2 added a second gradient to this shard's before optimizer.step(), but FORGE already applied this step's "
    "update of the shard inside the first backward, from that backward's gradient alone (then dropped). For "
    "gradient accumulation over k micro-batches construct the optimizer with accumulation_steps=k, or with "
    "fuse=False; otherwise call optimizer.step() after every backward. (After step(), clear the gradients with "
    "optimizer.zero_grad(), or with set_to_none=True: zeroing this placeholder in place leaves it in .grad.)"
)
_VIEWS = ("view", "alias", "detach", "_unsafe_view", "view_as", "as_strided")

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
        if op in _NORMS and any(isinstance(a, ReportingGrad) for a in ours):
            return _reported_norms(func, args, kwargs)
        if any(isinstance(a, ReportedNorm) for a in ours):
            if op in _SCALES:  # clip_grad_norm_'s scaling: the optimizer clips this step itself, once
                return args[0]
            if all(isinstance(a, ReportedNorm) for a in ours):  # arithmetic on reported norms: their values
                values = tree_map(lambda a: a.value if isinstance(a, ReportedNorm) else a, (args, kwargs))
                out = func(*values[0], **values[1])
                return tree_map(lambda o: ReportedNorm(o) if isinstance(o, torch.Tensor) else o, out)
        if func is torch.ops.aten._local_scalar_dense.default or op == "is_nonzero":
            if first.dtype != torch.bool:  # .item(), float(): the value is unknown
                return math.nan
            # `if total_norm > max_norm:`, `if total_norm.isnan():` decide on an unknown value
            raise RuntimeError(f"a decision on a value computed from the gradient of '{first.param_name}': "
                               + CLIP_MESSAGE)
        if op.endswith("_") or "out" in kwargs:
            return _in_place(op, args, ours, kinds)
        if op in _VIEWS and len(ours) == 1:  # a view of a placeholder is the same placeholder (DTensor wraps one)
            out = func(*tree_map(lambda a: torch.empty(a.shape, dtype=a.dtype, device="meta")
                                 if isinstance(a, torch.Tensor) else a, args), **kwargs)
            return Unknown(out.shape, out.dtype, first.device, first.kind, first.param_name)
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


_NORMS = ("linalg_vector_norm", "norm", "_foreach_norm")


def _reported_norms(func, args, kwargs):
    """The 2-norm of each gradient in a norm call (`torch.linalg.vector_norm(g)`, `torch._foreach_norm(grads)`) where
    one is a `ReportingGrad`: its reported norm, the others' computed, each a `ReportedNorm` in the gradient's
    dtype (as torch's norm of a gradient is)."""
    grads = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
    order = args[1] if len(args) > 1 else kwargs.get("ord", kwargs.get("p", 2))
    dims = args[2] if len(args) > 2 else kwargs.get("dim")
    dtype = kwargs.get("dtype")
    if order is None:
        order = 2
    if float(order) != 2.0 or dims not in (None, [], ()):
        first = next(g for g in grads if isinstance(g, ReportingGrad))
        raise RuntimeError(f"the gradient of the FORGE-fused weight '{first.param_name}' is known only by its 2-norm "
                           f"over the whole tensor (the optimizer clips it with max_grad_norm), not by a {order}-norm"
                           f"{'' if dims in (None, [], ()) else ' over dims ' + str(dims)}: clip by the 2-norm "
                           "(norm_type=2), or construct the optimizer with fuse=False")
    norms = []
    for g in grads:
        value = g.reported_norm() if isinstance(g, ReportingGrad) else torch.linalg.vector_norm(g, dtype=torch.float32)
        norms.append(ReportedNorm(value.to(dtype or g.dtype)))
    return norms if isinstance(args[0], (list, tuple)) else norms[0]


def _is_scalar(a) -> bool:
    return isinstance(a, (int, float)) or (isinstance(a, torch.Tensor) and a.numel() == 1 and a.device.type != "meta")


def _in_place(op: str, args, ours: list, kinds: set):
    """An in-place operation that involves an Unknown (see the module docstring)."""
    target = args[0]
    first = ours[0]
    targets = target if isinstance(target, (list, tuple)) else [target]
    if op == "zero_" and isinstance(target, Unknown):
        on_zero = getattr(target, "on_zero", None)
        if on_zero is not None:  # zero_grad(set_to_none=False) clears what the placeholder stands for
            on_zero()
        return target
    if op in _SCALES and kinds <= {"one", "grad"} and "one" in kinds:
        return target  # scaled by an infinite max_norm's coefficient, exactly 1: nothing to do
    if op in _CLAMPS:
        raise RuntimeError(f"clip_grad_value_ cannot clamp the gradient of the FORGE-fused weight '{first.param_name}': "
                           + VALUE_CLIP_MESSAGE)
    if op in _SCALES:
        raise RuntimeError(f"clipping cannot scale the gradient of the FORGE-fused weight '{first.param_name}', and the "
                           "total norm never saw it: " + CLIP_MESSAGE)
    if any(isinstance(t, Unknown) and t.kind == "shard" for t in targets):
        raise RuntimeError(f"'{first.param_name}': " + SHARD_ACCUMULATION_MESSAGE)
    if any(isinstance(t, Unknown) and t.kind == "grad" for t in targets):
        raise RuntimeError(f"'{first.param_name}': " + OUTSIDE_USE_MESSAGE)
    raise RuntimeError(f"a value computed from the gradient of the FORGE-fused weight '{first.param_name}', which FORGE "
                       f"applied inside backward and never stored, cannot be written into a tensor ({op})")


class ConsumedGrad(Unknown):
    """The `.grad` of a fused weight whose update was applied inside backward (see the module docstring)."""


class ReportingGrad(ConsumedGrad):
    """The `.grad` of a fused weight whose optimizer clips by the global norm itself: its 2-norm before clipping is
    `norm_of()` (a 0-d float32 tensor on its device, computed when asked), the rest as a `ConsumedGrad`."""

    @staticmethod
    def __new__(cls, weight: torch.Tensor, name: str, norm_of):
        t = ConsumedGrad.__new__(cls, weight.shape, weight.dtype, weight.device, "grad", name)
        t.norm_of = norm_of
        return t

    def reported_norm(self) -> torch.Tensor:
        return self.norm_of()


class ReportedNorm(Unknown):
    """A gradient norm that `clip_grad_norm_` computed from a `ReportingGrad`: a tensor that holds its `value` (what it
    reads as: `.item()`, comparisons, arithmetic give values that are again `ReportedNorm`s), and by which no gradient
    is scaled (see the module docstring)."""

    @staticmethod
    def __new__(cls, value: torch.Tensor):
        t = torch.Tensor._make_wrapper_subclass(cls, value.shape, dtype=value.dtype, device=value.device,
                                                requires_grad=False)
        t.value = value
        t.kind = "reported"
        t.param_name = ""
        return t

    def __repr__(self) -> str:
        return f"ReportedNorm({self.value!r})"


def consumed_grad(weight: torch.Tensor, name: str, kind: str = "grad") -> ConsumedGrad:
    """The placeholder `.grad` of `weight` [N, K], updated inside backward (`name`: its parameter's name); kind
    "shard": an FSDP2 shard's (forge_dsl/training/data_parallel.py), to which FSDP2 adds a second backward's
    gradient in place."""
    return ConsumedGrad(weight.shape, weight.dtype, weight.device, kind, name)
