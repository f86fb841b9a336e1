"""The public entry points: load a spec (`loading.load_spec`), make its state, run its reference step.

Every function that takes a spec accepts a built-in name (`"adamw"`), a path to
a `.fopt` file, or an already loaded `ir.Spec`.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional, Union

import torch

from .kernels.layouts import as_rows, quantize, resolve_layout, rows_cols, storage_shape
from .reference import ParamCopy, initial_scalars, initial_values, plain_state
from .spec import ir
from .spec.keywords import resolve_hypers
from .spec.loading import SpecLike, builtin_names, builtin_path, load_spec
from .spec.phases import extent_size

__all__ = ["load_spec", "builtin_names", "builtin_path", "init_state", "state_layout", "SpecLike"]

def init_state(
    spec: SpecLike,
    param: torch.Tensor,
    layout: Union[None, str, Mapping[str, str]] = None,
    *,
    initial_hypers: Optional[Mapping[str, float]] = None,
    **hypers,
) -> dict[str, torch.Tensor]:
    """Fresh optimizer state for one parameter.

    Args:
        spec: built-in name, path or loaded spec.
        param: the parameter (any shape); states are created on its device.
        layout: None keeps every state in `param`'s dtype (what `reference_step`
            runs on); "fp32", "bf16", "int8" or "int4" sets all states (for the
            kernels); a dict sets them per state name (missing names: "fp32").
            "int8" and "int4" quantize blocks of 64 elements along the last dim
            with one bf16 scale each (`layouts.SCALE_DTYPE`; the block maximum rounded
            up), stored under "<name>.scale"; states declared
            `nonneg` use the unsigned maps; a state whose last dim is below 64
            stays fp32. "int4" stores two codes a byte, `[..., cols / 2]` (int8;
            uint8 for nonneg states), and keeps a state of an odd last dim fp32
            (`forge_dsl.kernels.layouts`). States that must stay exact
            (`ir.State.must_stay_exact`: declared `exact`, or starting from `param`)
            are kept in fp32 under "bf16", "int8" and "int4"; a dict that names
            another layout for one raises (`state_layout`).
        initial_hypers: hyperparameter values (scalar names, e.g. `lr`, `beta1`) that
            initial values read instead of those in `hypers`: `ForgeOptimizer` passes
            the values its param group had at construction, before any LR schedule.
        **hypers: the keywords the step will use; they decide which states exist
            (e.g. `amsgrad=True`) and initial values that are hyperparameters
            (e.g. Adagrad's `initial_accumulator_value`).

    Returns:
        dict: each per-element state (a tensor shaped like `param`; int4 codes
        `[..., cols / 2]`) and each scalar state (a 0-dim float64 CPU tensor), by name.
    """
    spec = load_spec(spec)
    cfg = resolve_hypers(spec, hypers, caller="init_state")
    if initial_hypers:
        unknown = set(initial_hypers) - set(spec.hyper_names)
        if unknown:
            raise ValueError(f"initial_hypers names unknown hyperparameters {sorted(unknown)}; "
                             f"{spec.name} has {list(spec.hyper_names)}")
        cfg = dataclasses.replace(cfg, hypers={**cfg.hypers, **initial_hypers})  # initial values read only hypers
    if layout is None:
        return plain_state(spec, param, cfg, param.dtype)
    if isinstance(layout, Mapping):
        unknown = set(layout) - set(spec.state_names)
        if unknown:
            raise ValueError(
                f"layout names unknown states {sorted(unknown)}; {spec.name} has states {list(spec.state_names)}"
            )
    out: dict[str, torch.Tensor] = {}
    rows, cols = rows_cols(param.shape)
    values = initial_values(spec, cfg)
    for s in spec.states:
        if s.name not in values:
            continue
        value = values[s.name]
        if s.extent is not None:  # per row or per column: fp32 (`ir.State.must_stay_exact`)
            state_layout(spec, s, layout)  # a layout dict that names another for it raises
            out[s.name] = torch.full((extent_size(param.shape, s.extent),), value, dtype=torch.float32,
                                     device=param.device)
            continue
        code = resolve_layout(state_layout(spec, s, layout), s.nonneg, param.shape)
        if isinstance(value, ParamCopy):
            storage, scale = quantize(as_rows(value.of(param, torch.float32)), code)
            out[s.name] = storage.reshape(storage_shape(code, param.shape))
        else:
            # Every row starts equal: encode one row and repeat it, so a large parameter never needs
            # a float32 copy of its state (5.8 GiB for AdamW on a 151936 × 5120 embedding).
            row = torch.full((1, cols), value, dtype=torch.float32, device=param.device)
            storage, scale = quantize(row, code)
            out[s.name] = storage.expand(rows, storage.shape[1]).contiguous().reshape(storage_shape(code, param.shape))
            if scale is not None:
                scale = scale.expand(rows, scale.shape[1]).contiguous()
        if scale is not None:
            out[f"{s.name}.scale"] = scale
    return {**out, **initial_scalars(spec, cfg)}


def state_layout(spec: ir.Spec, state: ir.State, layout: Union[str, Mapping[str, str]]) -> str:
    """The layout name one state gets from `init_state`'s `layout` (a name for all states, or a dict).

    The rule for states that must stay exact (`ir.State.must_stay_exact`): a layout named for all
    states leaves them in "fp32"; a dict that names "bf16", "int8" or "int4" for one is refused, since its
    values (weight-like ones, for a state that starts from `param`) would lose their precision.
    """
    if isinstance(layout, Mapping):
        choice = layout.get(state.name, "fp32")
        if state.must_stay_exact and choice != "fp32":
            why = ("it is declared exact" if state.exact else f"it is one value per {state.unit}" if
                   state.extent is not None else "it starts from param (it holds weight-like values)")
            raise ValueError(
                f"state '{state.name}' of {spec.name} must stay in fp32 because {why}, but the layout asks for "
                f"{choice!r}; leave it out of the layout dict (it then stays fp32)"
            )
        return choice
    return "fp32" if state.must_stay_exact else layout
