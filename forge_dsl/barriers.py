"""The region of a spec in phases (`spec.phases`: its functions of the whole weight, its states per row or column
and the arithmetic between them), in eager torch.

One home for its arithmetic: the reference step and the optimizer's runtime both call `run_region`.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from .eager import elementwise, host_tensor
from .spec import ir
from .spec.names import BARRIER_FUNCTIONS, ROW_COLUMN_FUNCTIONS
from .spec.phases import Plan, shape_values
from .spec.variants import evaluate, iter_names

__all__ = ["orthogonalize", "reduce_whole", "run_region"]

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


def run_region(phases: Plan, values: Mapping[str, torch.Tensor], cfg, step: int,
               param_eps: float) -> tuple[torch.Tensor, dict[str, float]]:
    """A plan's region after one weight's tile phase (`spec.phases`), then what its post phase reads.

    Runs the region's statements in order on the whole weight seen as a matrix [rows, cols] (`phases.shape_values`),
    in the weight's dtype promoted to at least fp32: values per element [rows, cols], per row [rows, 1], per column
    [1, cols], per tensor 0-dim (kept on the device), host values (keywords, `step`, the shape) Python floats,
    combined in float64 and rounded once where a tensor reads them (docs/LANGUAGE.md, section 6). A state per row or
    per column is written in place. A temporary is dropped after the last statement that reads it, so the fp32
    temporaries shaped like the weight alive at once are those its statements still need.

    Args:
        phases: the spec's plan (with a post phase).
        values: `param` [*shape]; the spec's states (per element [*shape] in their stored dtype, fp32 or bf16; per
            row [rows]; per column [cols]) and the transients [*shape], by name.
        cfg: the spec's resolved keywords (`keywords.StepConfig`).
        step: this step's number.
        param_eps: the machine epsilon of the dtype the weight is stored in (`param_eps`).

    Returns:
        (the post phase's grad [*shape]: the value it names, else `param` where it reads none; the per-tensor
        values the post phase reads, read back to the host as Python floats, by name). The region's other values
        per element that the post phase reads are written to their transients (`Plan.region_kept`).
    """
    param = values["param"]
    shape = tuple(param.shape)
    sizes = shape_values(shape, param_eps)
    rows, cols = int(sizes["rows"]), int(sizes["cols"])
    like = torch.empty((), dtype=torch.promote_types(param.dtype, torch.float32), device=param.device)
    host: dict[str, Any] = {**cfg.hypers, **cfg.flags, **cfg.choices, "step": float(step), **sizes}
    extents = {s.name: s.extent for s in phases.spec.states}
    env: dict[str, torch.Tensor] = {}
    wanted = {"param", *phases.spec.state_names, *phases.transients}
    for name, t in values.items():
        if name not in wanted:  # the step counter, the rounding seed
            continue
        extent = extents.get(name)
        env[name] = t.reshape((rows, 1) if extent == "rows" else (1, cols) if extent == "cols" else (rows, cols)
                              ).to(like.dtype)
    kept_to_the_end = {*phases.results, *phases.region_kept, phases.post_grad}
    last_read = phases.region_last_reads
    for i, stmt in enumerate(phases.region):
        _run((stmt,), env, host, values, extents, like)
        for name in [n for n in env if last_read.get(n, -1) <= i and n not in wanted and n not in kept_to_the_end]:
            del env[name]  # a temporary nothing reads again: its memory back before the next statement
    results = {}
    for name in phases.results:
        results[name] = env[name] if name in env else host[name]
    read = [name for name, v in results.items() if isinstance(v, torch.Tensor)]
    if read:  # one synchronization for them all
        results.update(zip(read, torch.stack([results[n].reshape(()) for n in read]).tolist()))
    for name, kept in phases.region_kept.items():
        values[kept].copy_(env[name].expand(rows, cols).reshape(shape))
    if phases.post_grad is None:
        return param, {n: float(v) for n, v in results.items()}
    grad = env[phases.post_grad].expand(rows, cols).reshape(shape)
    return grad.contiguous(), {n: float(v) for n, v in results.items()}


def _run(body, env: dict, host: dict, stored: Mapping[str, torch.Tensor], extents: Mapping, like) -> None:
    """Run statements of a region: values in `env` (tensors) or `host` (Python numbers); a state per row or column
    (`extents`) is written to its tensor in `stored` too."""
    for stmt in body:
        if isinstance(stmt, ir.If):
            _run(stmt.then if evaluate(stmt.condition, host) else stmt.orelse, env, host, stored, extents, like)
            continue
        value = _value(stmt.value, env, host, like)
        target = stmt.target
        if isinstance(value, torch.Tensor):
            env[target] = value
            host.pop(target, None)
        else:
            host[target] = value
            env.pop(target, None)
        extent = extents.get(target)
        if extent is not None:
            t = stored[target]
            full = host_tensor(value, like) if not isinstance(value, torch.Tensor) else value
            t.copy_(full.expand((t.numel(), 1) if extent == "rows" else (1, t.numel())).reshape(t.shape))
            env[target] = t.reshape((t.numel(), 1) if extent == "rows" else (1, t.numel())).to(like.dtype)
            host.pop(target, None)


def _value(expr: ir.Expr, env: Mapping[str, torch.Tensor], host: Mapping[str, Any], like: torch.Tensor):
    """`expr`'s value: a Python number where it reads no tensor (evaluated in float64), else a tensor."""
    if not any(n.id in env for n in iter_names(expr)):
        return evaluate(expr, host)
    if isinstance(expr, ir.Name):
        return env[expr.id]
    if isinstance(expr, ir.Call) and expr.func in BARRIER_FUNCTIONS:
        x = env[expr.args[0].id]
        if expr.func in ROW_COLUMN_FUNCTIONS:  # x broadcasts to [rows, cols]
            return x.mean(dim=1 if expr.func == "rowmean" else 0, keepdim=True) if x.dim() == 2 else x
        if expr.func == "orthogonalize":
            return orthogonalize(x, *(float(evaluate(a, host)) for a in expr.args[1:])).to(like.dtype)
        return reduce_whole(expr.func, x).to(like.dtype)
    if isinstance(expr, ir.Unary):
        args = [expr.operand]
    elif isinstance(expr, ir.Binary):
        args = [expr.left, expr.right]
    else:
        args = list(expr.args)
    values = [_value(a, env, host, like) for a in args]
    values = [v if isinstance(v, torch.Tensor) else host_tensor(v, like) for v in values]
    op = expr.op if isinstance(expr, (ir.Unary, ir.Binary)) else expr.func
    return elementwise(op, values)
