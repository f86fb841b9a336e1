"""The reference step: a lowered program executed in eager PyTorch.

This is the readable, obviously-correct path every fast kernel is tested
against, and it is itself tested against torch.optim.  It runs the *lowered*
program (host scalars in float64 on the host, then the per-element program in
the parameter's dtype), so parity with torch.optim also checks the lowering.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, MutableMapping, Optional, Union

import torch

from .barriers import run_region
from .eager import elementwise, host_tensor
from .compiler.lowering import Lowered, Operand, lower
from .spec import ir
from .spec.phases import extent_size, is_phased, plan
from .spec.keywords import StepConfig, check_step, resolve_hypers
from .spec.loading import load_spec
from .spec.scalar_ops import apply_scalar_op
from .spec.variants import states_present

__all__ = ["run_host_program", "scalar_updates", "reference_step", "initial_value", "initial_values", "ParamCopy",
           "plain_state"]


def initial_value(spec: ir.Spec, init: ir.Expr, hypers: Mapping[str, float]) -> float:
    """The number a state starts at: a literal, or a hyperparameter's value, or their negation (not for
    `param`: see `ParamCopy`)."""
    sign, base = ir.initial_parts(init)
    if isinstance(base, ir.Num):
        return sign * base.value
    assert isinstance(base, ir.Name) and base.id != "param", init
    return sign * hypers[base.id]


def initial_values(spec: ir.Spec, cfg: StepConfig) -> dict[str, Union[float, ParamCopy]]:
    """The initial value of each per-element state present for these flags: the number every element
    starts at, or a `ParamCopy` for a state that starts as (minus) the weight (`ir.State.starts_from_param`)."""
    return {s.name: (_param_sign(s) if s.starts_from_param else initial_value(spec, s.init, cfg.hypers))
            for s in states_present(spec, cfg.flags)}


def _param_sign(s: ir.State) -> ParamCopy:
    return ParamCopy(ir.initial_parts(s.init)[0])


@dataclass(frozen=True)
class ParamCopy:
    """The initial value of a state declared `= param` (`sign` 1) or `= -param` (`sign` -1)."""

    sign: float

    def of(self, param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A new tensor shaped like `param`, in `dtype`: sign * param, rounded once to dtype."""
        return (param.to(dtype, copy=True) if self.sign > 0 else -param.to(dtype)).contiguous()


def initial_scalars(spec: ir.Spec, cfg: StepConfig) -> dict[str, torch.Tensor]:
    """Each scalar state's initial value, as a 0-dim float64 CPU tensor."""
    return {s.name: torch.tensor(initial_value(spec, s.init, cfg.hypers), dtype=torch.float64) for s in spec.scalars}


def plain_state(spec: ir.Spec, param: torch.Tensor, cfg: StepConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Fresh state in `dtype`: per-element states present for these flags (a state per row or column: [rows] or
    [cols]), then scalar states. A state that must stay exact (`ir.State.must_stay_exact`) is at least float32 (a bfloat16 `dtype` would ruin it)."""
    exact = {s.name for s in spec.states if s.must_stay_exact}
    state: dict[str, torch.Tensor] = {}
    for name, value in initial_values(spec, cfg).items():
        own = torch.promote_types(dtype, torch.float32) if name in exact else dtype
        extent = next(s.extent for s in spec.states if s.name == name)
        if isinstance(value, ParamCopy):
            state[name] = value.of(param, own)
        elif extent is not None:
            state[name] = torch.full((extent_size(param.shape, extent),), value, dtype=own, device=param.device)
        else:
            state[name] = torch.full_like(param, value, dtype=own)
    return {**state, **initial_scalars(spec, cfg)}


def run_host_program(low: Lowered, hypers: Mapping[str, Any], step: int, scalars: Mapping[str, float]) -> dict:
    """Execute the host program in float64; `hypers` holds the hyperparameters and the runtime flags
    (`StepConfig.host_inputs`).

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


def reference_step(
    spec,
    param: torch.Tensor,
    grad: torch.Tensor,
    state: MutableMapping[str, torch.Tensor],
    *,
    step: int,
    weight_dtype: Optional[torch.dtype] = None,
    **hypers,
) -> None:
    """One optimizer step in eager PyTorch, updating `param` and `state` in place.

    Args:
        spec: a built-in name (`"adamw"`), a path to a `.fopt`, or a loaded spec.
        param: the parameter, any shape, any float dtype (float64 for exact checks).
        grad: its gradient, same shape and dtype.
        state: what `forge_dsl.init_state(spec, param, ...)` returned (plain float layouts).
        step: the 1-based number of this step.
        weight_dtype: the dtype the weight is stored in, where the step computes in `param`'s (a bfloat16 weight
            run in float32 or float64): the new weight and the spec's `stored(x)` are rounded to it, to nearest
            even, as the kernels' store does with rounding="nearest" (bit for bit from float32). None: `param`'s
            dtype, which rounds nothing away. The kernels' stochastic rounding is not reproduced (its bits are
            a function of the launch: tests/kernels/test_stored.py bounds it).
        **hypers: torch-style keywords (`lr=1e-3, betas=(0.9, 0.999), amsgrad=True`, ...).

    Raises:
        SpecError: the spec is not valid (an `ir.Spec` from `parse_spec` is checked here).
        TypeError: unknown or missing keywords.
        ValueError: a hyperparameter outside its range, a failed `require`, a state
            (per element or scalar) missing, or tensors that do not match.
    """
    spec = load_spec(spec)
    cfg = resolve_hypers(spec, hypers, caller="reference_step")
    if is_phased(spec):
        _phased_step(spec, cfg, param, grad, state, step=step, weight_dtype=weight_dtype)
        return
    low = lower(spec, cfg.combo)
    step = check_step(step)
    if weight_dtype is None:
        weight_dtype = param.dtype
    if not (isinstance(weight_dtype, torch.dtype) and weight_dtype.is_floating_point):
        raise ValueError(f"weight_dtype must be a float torch.dtype (the weight's storage, e.g. torch.bfloat16) or "
                         f"None, got {weight_dtype!r}")
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
    missing = [s.name for s in spec.scalars if s.name not in state]
    if missing:  # as kernels.step: a state dict without them is not this spec's (init_state creates them)
        raise ValueError(
            f"state has no scalar state {', '.join(map(repr, missing))} (needed by {spec.name}); "
            "create the state with forge_dsl.init_state(spec, param, **hypers)"
        )
    scalars = {s.name: float(state[s.name]) for s in spec.scalars}
    host = run_host_program(low, cfg.host_inputs, int(step), scalars)

    # Every output is computed from the inputs as they were before the step, whatever aliases what
    # (an output that is an input, grad sharing storage with param or a state): the inputs read are
    # copied first, and nothing is written until every output is computed.
    inputs = {name: (param if name == "param" else grad if name == "grad" else state[name]).clone()
              for name in low.element_inputs}
    env: dict[str, torch.Tensor] = {}

    def value(o: Operand) -> torch.Tensor:
        if o.kind == "const" or o.is_host:
            return host_tensor(_host_value(o, host), param)
        if o.kind == "state":
            return inputs[o.name]
        if o.kind in ("param", "grad"):
            return inputs[o.kind]
        return env[o.name]

    def stored(x: torch.Tensor) -> torch.Tensor:
        """x as the weight's store rounds it: to `weight_dtype`, nearest even (torch's conversion)."""
        return x.to(weight_dtype).to(param.dtype).expand(param.shape)

    for instr in low.elem:
        args = [value(a) for a in instr.args]
        env[instr.name] = stored(*args) if instr.op == "stored" else elementwise(instr.op, args)
    new_values = [(target, stored(value(o)) if target == "param" else value(o)) for target, o in low.outputs]
    for target, v in new_values:
        (param if target == "param" else state[target]).copy_(v)
    for name, v in scalar_updates(low, host).items():
        state[name].fill_(v)


def _phased_step(spec: ir.Spec, cfg, param: torch.Tensor, grad: torch.Tensor, state: MutableMapping[str, torch.Tensor],
                 *, step: int, weight_dtype: Optional[torch.dtype]) -> None:
    """`reference_step` of a spec split into phases (`spec.phases.plan`): the tile phase's reference step, with its
    transients zero-filled tensors like `param`; the region on the whole tensor (`barriers.run_region`, in `param`'s
    dtype); the post phase's reference step with the value the region hands it (or the gradient handed over) as its
    gradient and the region's per-tensor values as its keywords. `param_eps` is the machine epsilon of
    `weight_dtype` (else `param`'s dtype)."""
    phases = plan(spec)
    step = check_step(step)
    param_eps = torch.finfo(weight_dtype or param.dtype).eps
    transients = {name: torch.zeros_like(param) for name in phases.transients}
    held = {**{name: state[name] for name in list(spec.state_names) + list(spec.scalar_names) if name in state},
            **transients}
    tile_state = {s.name: held[s.name] for s in phases.tile.states if s.name in held}
    tile_state.update({name: held[name] for name in phases.tile.scalar_names if name in held})
    reference_step(phases.tile, param, grad, tile_state, step=step, weight_dtype=weight_dtype,
                   **phases.keywords(phases.tile, cfg, param.shape, param_eps))
    if phases.post is None:
        return
    post_grad, results = run_region(phases, {**held, "param": param}, cfg, step, param_eps)
    post_grad = post_grad.to(param.dtype)
    post_state = {s.name: held[s.name] for s in phases.post.states}
    reference_step(phases.post, param, post_grad, post_state, step=step, weight_dtype=weight_dtype,
                   **phases.keywords(phases.post, cfg, param.shape, param_eps, results))
