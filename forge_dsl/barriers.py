"""The functions of the whole weight a spec may call between its phases (`spec.phases`), in eager torch.

One home for their arithmetic: the reference step and the optimizer's runtime both call `apply_barrier`.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch

from .spec.phases import Plan, barrier_arguments

__all__ = ["apply_barrier", "orthogonalize", "reduce_whole", "run_stage"]

MAX_NS_STEPS = 100  # torch.optim.Muon refuses ns_steps >= 100


def orthogonalize(x: torch.Tensor, steps: float, a: float, b: float, c: float, eps: float) -> torch.Tensor:
    """torch.optim.Muon's Newton-Schulz orthogonalization of a matrix, operation for operation.

    Args:
        x: [rows, cols], any float dtype (rounded to bfloat16 first, as torch.optim.Muon does).
        steps: the number of iterations, a whole number in [0, 100).
        a, b, c: the quintic's coefficients (torch.optim.Muon's ns_coefficients).
        eps: the floor of the Frobenius norm x is divided by.

    Returns:
        [rows, cols] bfloat16: X ≈ U Vᵀ of x = U S Vᵀ (singular values near 1), computed on the wide orientation
        (transposed when rows > cols) in bfloat16 matmuls, as torch computes them.

    Raises:
        ValueError: x is not 2-D, or steps is not a whole number in [0, 100).
    """
    if x.dim() != 2:
        raise ValueError(f"orthogonalize() needs a 2-D weight (torch.optim.Muon steps only matrices), got shape "
                         f"{tuple(x.shape)}")
    if steps != int(steps) or not 0 <= steps < MAX_NS_STEPS:
        raise ValueError(f"orthogonalize(): ns_steps must be a whole number in [0, {MAX_NS_STEPS}), got {steps!r}")
    ortho = x.bfloat16()
    tall = x.size(0) > x.size(1)
    if tall:
        ortho = ortho.T
    ortho = ortho.div(ortho.norm().clamp(min=eps))
    for _ in range(int(steps)):
        gram = ortho @ ortho.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.addmm(ortho, update, ortho, beta=a)
    return ortho.T if tall else ortho


def reduce_whole(func: str, x: torch.Tensor) -> torch.Tensor:
    """`norm`, `sum` or `mean` of x over every element, in x's dtype promoted to at least float32 (a bfloat16
    state or weight is read as float32). Returns a 0-dim tensor on x's device."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    if func == "norm":
        return torch.linalg.vector_norm(x)
    if func == "sum":
        return x.sum()
    if func == "mean":
        return x.mean()
    raise AssertionError(f"no reduction {func!r}")


def apply_barrier(func: str, x: torch.Tensor, args: tuple[float, ...]) -> torch.Tensor:
    """`func(x, *args)` for a barrier function of `spec.names.BARRIER_FUNCTIONS`: a matrix shaped like x
    (`orthogonalize`) or a 0-dim tensor (`norm`, `sum`, `mean`)."""
    if func == "orthogonalize":
        return orthogonalize(x, *args)
    return reduce_whole(func, x)


def run_stage(phases: Plan, values: Mapping[str, torch.Tensor], hypers: Mapping[str, Optional[float]],
              step: int) -> tuple[torch.Tensor, dict[str, float]]:
    """A plan's barrier stage after one weight's tile phase, then what its post phase reads.

    Args:
        phases: the spec's plan (with a post phase).
        values: `param` [*shape] and the tile phase's states and transients by name, each [*shape].
        hypers: the spec's resolved keywords (`StepConfig.hypers`).
        step: this step's number.

    Returns:
        (the post phase's grad [*shape]: the matrix result, else the value it names, else `param` where it reads
        none; the per-tensor results by target, read back to the host as Python floats).
    """
    param = values["param"]
    values = dict(values)
    results: dict[str, float] = {}
    for b in phases.barriers:
        out = apply_barrier(b.func, values[b.source], barrier_arguments(b, hypers, step, param.shape))
        if b.per_tensor:
            results[b.target] = float(out)
        else:
            values[b.target] = out.contiguous()
    return (values[phases.post_grad] if phases.post_grad is not None else param), results
