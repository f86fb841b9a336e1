"""The reference step: a lowered program executed in eager PyTorch.

This is the readable, obviously-correct path every fast kernel is tested
against, and it is itself tested against torch.optim.  It runs the *lowered*
program (host scalars in float64 on the host, then the per-element program in
the parameter's dtype), so parity with torch.optim also checks the lowering.
"""

from __future__ import annotations

from typing import Any, Mapping, MutableMapping

import torch

from . import ir
from .config import StepConfig, resolve_hypers
from .lowering import Lowered, Operand, lower
from .scalar_ops import apply_scalar_op

__all__ = ["run_host_program", "scalar_updates", "reference_step", "initial_value", "plain_state"]


def initial_value(spec: ir.Spec, init: ir.Expr, hypers: Mapping[str, float]) -> float:
    """The number a state starts at: a literal, or a hyperparameter's value."""
    if isinstance(init, ir.Num):
        return init.value
    if isinstance(init, ir.Unary):
        return -initial_value(spec, init.operand, hypers)
    assert isinstance(init, ir.Name)
    return hypers[init.id]


def initial_values(spec: ir.Spec, cfg: StepConfig) -> dict[str, float]:
    """The initial value of each per-element state present for these flags (every element starts equal)."""
    present = lower(spec, cfg.combo).states
    return {s.name: initial_value(spec, s.init, cfg.hypers) for s in spec.states if s.name in present}


def initial_scalars(spec: ir.Spec, cfg: StepConfig) -> dict[str, torch.Tensor]:
    """Each scalar state's initial value, as a 0-dim float64 CPU tensor."""
    return {s.name: torch.tensor(initial_value(spec, s.init, cfg.hypers), dtype=torch.float64) for s in spec.scalars}


def plain_state(spec: ir.Spec, param: torch.Tensor, cfg: StepConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Fresh state in `dtype`: per-element states present for these flags, then scalar states."""
    state: dict[str, torch.Tensor] = {}
    for name, value in initial_values(spec, cfg).items():
        state[name] = torch.full_like(param, value, dtype=dtype)
    return {**state, **initial_scalars(spec, cfg)}


def run_host_program(low: Lowered, hypers: Mapping[str, float], step: int, scalars: Mapping[str, float]) -> dict:
    """Execute the host program in float64.

    Returns every host value by name: the inputs (hyperparameters, scalar state,
    `step`) and each computed value.  Names never collide: the checker keeps
    declared names, temporaries and the built-in `step` apart.
    """
    env: dict[str, Any] = {**hypers, **scalars, "step": float(step)}
    for instr in low.host:
        env[instr.name] = apply_scalar_op(instr.op, *(_host_value(a, env) for a in instr.args))
    return env


def _host_value(o: Operand, host: Mapping[str, Any]):
    return o.value if o.kind == "const" else host[o.name]


def scalar_updates(low: Lowered, host: Mapping[str, Any]) -> dict[str, float]:
    """The new value of each scalar state after this step, from `run_host_program`'s values."""
    return {name: float(_host_value(o, host)) for name, o in low.scalar_updates}


def _tensor(x, like: torch.Tensor) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    return torch.tensor(x, dtype=torch.bool if isinstance(x, bool) else like.dtype, device=like.device)


def _elementwise(op: str, args: list, like: torch.Tensor):
    """One per-element operation; args are tensors, Python floats or Python bools."""
    if op == "where":
        cond, a, b = args
        if not isinstance(cond, torch.Tensor):
            return a if cond else b
        return torch.where(cond, _tensor(a, like), _tensor(b, like))
    if op in ("add", "sub", "mul", "div", "pow", "lt", "le", "gt", "ge", "eq", "ne"):
        a, b = args
        return {
            "add": lambda: a + b,
            "sub": lambda: a - b,
            "mul": lambda: a * b,
            "div": lambda: a / b,
            "pow": lambda: a**b,
            "lt": lambda: a < b,
            "le": lambda: a <= b,
            "gt": lambda: a > b,
            "ge": lambda: a >= b,
            "eq": lambda: a == b,
            "ne": lambda: a != b,
        }[op]()
    if op in ("and", "or"):
        a, b = (_tensor(x, like) for x in args)
        return torch.logical_and(a, b) if op == "and" else torch.logical_or(a, b)
    if op == "min":
        return torch.minimum(*(_tensor(x, like) for x in args))
    if op == "max":
        return torch.maximum(*(_tensor(x, like) for x in args))
    if op == "clamp":
        x, lo, hi = (_tensor(v, like) for v in args)
        return torch.minimum(torch.maximum(x, lo), hi)
    (a,) = args
    return {
        "neg": lambda: -a,
        "not": lambda: torch.logical_not(a),
        "recip": lambda: torch.reciprocal(a),
        "sqrt": lambda: torch.sqrt(a),
        "rsqrt": lambda: torch.rsqrt(a),
        "abs": lambda: torch.abs(a),
        "sign": lambda: torch.sign(a),
        "exp": lambda: torch.exp(a),
        "log": lambda: torch.log(a),
    }[op]()


def reference_step(
    spec,
    param: torch.Tensor,
    grad: torch.Tensor,
    state: MutableMapping[str, torch.Tensor],
    *,
    step: int,
    **hypers,
) -> None:
    """One optimizer step in eager PyTorch, updating `param` and `state` in place.

    Args:
        spec: a built-in name (`"adamw"`), a path to a `.fopt`, or a loaded spec.
        param: the parameter, any shape, any float dtype (float64 for exact checks).
        grad: its gradient, same shape and dtype.
        state: what `forge_dsl.init_state(spec, param, ...)` returned (plain float layouts).
        step: the 1-based number of this step.
        **hypers: torch-style keywords (`lr=1e-3, betas=(0.9, 0.999), amsgrad=True`, ...).

    Raises:
        TypeError: unknown or missing keywords.
        ValueError: a hyperparameter outside its range, a failed `require`, or
            tensors that do not match.
    """
    from .api import load_spec  # late import: api is the top of the stack

    spec = load_spec(spec)
    cfg = resolve_hypers(spec, hypers, caller="reference_step")
    low = lower(spec, cfg.combo)
    if isinstance(step, bool) or int(step) != step or step < 1:
        raise ValueError(f"step must be a positive integer (1 for the first step), got {step!r}")
    if grad.shape != param.shape:
        raise ValueError(f"grad has shape {tuple(grad.shape)} but param has shape {tuple(param.shape)}; they must match")
    for name in low.states:
        if name not in state:
            raise ValueError(
                f"state has no '{name}' (needed by {spec.name} with {', '.join(f'{k}={v}' for k, v in low.combo)}); "
                "create it with forge_dsl.init_state(spec, param, **hypers) using the same flags"
            )
        t = state[name]
        if t.shape != param.shape or not t.is_floating_point():
            raise ValueError(
                f"state '{name}' must be a float tensor shaped like param {tuple(param.shape)}, "
                f"got {t.dtype} {tuple(t.shape)}; reference_step runs on plain float state"
            )
    scalars = {s.name: float(state[s.name]) for s in spec.scalars}
    host = run_host_program(low, cfg.hypers, int(step), scalars)

    env: dict[str, Any] = {}

    def value(o: Operand):
        if o.kind == "const" or o.is_host:
            return _host_value(o, host)
        if o.kind == "param":
            return param
        if o.kind == "grad":
            return grad
        if o.kind == "state":
            return state[o.name]
        return env[o.name]

    for instr in low.elem:
        env[instr.name] = _elementwise(instr.op, [value(a) for a in instr.args], param)
    # Inputs that are outputs unchanged are cloned: every output is computed before any is written.
    new_values = [
        (target, value(o).clone() if o.kind in ("param", "state") else value(o)) for target, o in low.outputs
    ]
    for target, v in new_values:
        dest = param if target == "param" else state[target]
        if isinstance(v, torch.Tensor):
            dest.copy_(v)
        else:
            dest.fill_(v)
    for name, v in scalar_updates(low, host).items():
        state[name].fill_(v)
