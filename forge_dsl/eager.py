"""The language's per-element operations in eager torch: one home for their arithmetic, which the reference step
(`reference.py`, on the lowered program) and the region of a spec in phases (`barriers.run_region`, on the spec's
own expressions) both run."""

from __future__ import annotations

import torch

__all__ = ["elementwise", "host_tensor"]


def host_tensor(x, like: torch.Tensor) -> torch.Tensor:
    """A host value (Python float or bool) as a 0-dim tensor in `like`'s dtype: a float64 rounded once to it,
    to nearest even, as the kernels round theirs to fp32 (docs/LANGUAGE.md, section 6)."""
    if isinstance(x, bool):
        return torch.tensor(x, dtype=torch.bool, device=like.device)
    return torch.tensor(x, dtype=torch.float64, device=like.device).to(like.dtype)


_BINARY = {
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "div": torch.div,
    "pow": torch.pow,
    "atan2": torch.atan2,
    "lt": torch.lt,
    "le": torch.le,
    "gt": torch.gt,
    "ge": torch.ge,
    "eq": torch.eq,
    "ne": torch.ne,
    "and": torch.logical_and,
    "or": torch.logical_or,
    "min": torch.minimum,  # NaN if either is NaN
    "max": torch.maximum,
}

_UNARY = {
    "neg": torch.neg,
    "not": torch.logical_not,
    "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt,
    "abs": torch.abs,
    # torch.sign(NaN) is 0; the language's sign keeps NaN (as IEEE and the kernels do), and the sign of a zero
    "sign": lambda a: torch.where(torch.isnan(a) | (a == 0), a, torch.sign(a)),
    "exp": torch.exp,
    "log": torch.log,
    "atan": torch.atan,
    "tanh": torch.tanh,
    "erf": torch.erf,
    "log1p": torch.log1p,
    "expm1": torch.expm1,
}


def elementwise(op: str, args: list[torch.Tensor]) -> torch.Tensor:
    """One per-element operation on tensors that broadcast (host values are 0-dim tensors)."""
    if op == "where":
        return torch.where(*args)
    if op == "clamp":
        x, lo, hi = args
        return torch.minimum(torch.maximum(x, lo), hi)
    if op in _BINARY:
        return _BINARY[op](*args)
    return _UNARY[op](*args)
