"""The public entry points: load a spec, make its state, run its reference step.

Every function that takes a spec accepts a built-in name (`"adamw"`), a path to
a `.fopt` file, or an already loaded `ir.Spec`.
"""

from __future__ import annotations

import functools
import os
from importlib import resources
from pathlib import Path
from typing import Mapping, Union

import torch

from . import ir
from .checker import check_spec
from .config import resolve_hypers
from .errors import did_you_mean
from .parser import parse_spec
from .layouts import quantize, resolve_layout, rows_cols
from .reference import initial_scalars, initial_values, plain_state

__all__ = ["load_spec", "builtin_names", "builtin_path", "init_state", "SpecLike"]

SpecLike = Union[str, os.PathLike, ir.Spec]


def builtin_names() -> list[str]:
    """Names of the specs shipped in optimizers/ (forge_dsl.optimizers)."""
    return list(_builtin_names())


@functools.lru_cache(maxsize=1)
def _builtin_names() -> tuple[str, ...]:
    root = resources.files("forge_dsl.optimizers")
    return tuple(sorted(p.name[: -len(".fopt")] for p in root.iterdir() if p.name.endswith(".fopt")))


def builtin_path(name: str) -> Path:
    return Path(str(resources.files("forge_dsl.optimizers").joinpath(f"{name}.fopt")))


@functools.lru_cache(maxsize=128)
def _load_text(source: str, path: str) -> ir.Spec:
    return check_spec(parse_spec(source, path))


def load_spec(spec: SpecLike) -> ir.Spec:
    """Parse and check a spec.

    Args:
        spec: a built-in name such as "adamw", a path to a `.fopt` file, or an `ir.Spec`
            (returned as is).

    Raises:
        SpecError: the spec has a problem (printed as `path:line:col: message`).
        FileNotFoundError: no such built-in name or file.
    """
    if isinstance(spec, ir.Spec):
        return spec
    text = os.fspath(spec)
    if text.endswith(".fopt") or os.sep in text or "/" in text:
        path = Path(text)
        if not path.is_file():
            raise FileNotFoundError(f"no spec file at '{text}'")
        return _load_text(path.read_text(), text)
    return _load_builtin(text)


@functools.lru_cache(maxsize=64)
def _load_builtin(text: str) -> ir.Spec:
    names = builtin_names()
    if text not in names:
        raise FileNotFoundError(
            f"no built-in optimizer named '{text}'" + did_you_mean(text, names)
            + f" (built-ins: {', '.join(names)}; or pass a path to a .fopt file)"
        )
    path = builtin_path(text)
    return _load_text(path.read_text(), f"optimizers/{text}.fopt")


def init_state(
    spec: SpecLike, param: torch.Tensor, layout: Union[None, str, Mapping[str, str]] = None, **hypers
) -> dict[str, torch.Tensor]:
    """Fresh optimizer state for one parameter.

    Args:
        spec: built-in name, path or loaded spec.
        param: the parameter (any shape); states are created on its device.
        layout: None keeps every state in `param`'s dtype (what `reference_step`
            runs on); "fp32", "bf16" or "int8" sets all states (for the kernels);
            a dict sets them per state name (missing names: "fp32").  "int8"
            quantizes blocks of 64 elements along the last dim with one fp32
            scale each, stored under "<name>.scale"; states declared `nonneg`
            use the unsigned map; a state whose last dim is below 64 stays fp32.
        **hypers: the keywords the step will use; they decide which states exist
            (e.g. `amsgrad=True`) and initial values that are hyperparameters
            (e.g. Adagrad's `initial_accumulator_value`).

    Returns:
        dict: each per-element state (a tensor shaped like `param`) and each
        scalar state (a 0-dim float64 CPU tensor), by name.
    """
    spec = load_spec(spec)
    cfg = resolve_hypers(spec, hypers, caller="init_state")
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
        value = values.get(s.name)
        if value is None:
            continue
        choice = layout.get(s.name, "fp32") if isinstance(layout, Mapping) else layout
        # Every row starts equal: encode one row and repeat it, so a large parameter never needs
        # a float32 copy of its state (5.8 GiB for AdamW on a 151936 × 5120 embedding).
        row = torch.full((1, cols), value, dtype=torch.float32, device=param.device)
        storage, scale = quantize(row, resolve_layout(choice, s.nonneg, param.shape))
        out[s.name] = storage.expand(rows, cols).contiguous().reshape(param.shape)
        if scale is not None:
            out[f"{s.name}.scale"] = scale.expand(rows, scale.shape[1]).contiguous()
    return {**out, **initial_scalars(spec, cfg)}
