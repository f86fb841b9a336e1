"""The public entry points: load a spec, make its state, run its reference step.

Every function that takes a spec accepts a built-in name (`"adamw"`), a path to
a `.fopt` file, or an already loaded `ir.Spec`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from importlib import resources
from pathlib import Path
from typing import Mapping, Optional, Union

import torch

from . import ir
from .checker import check_spec
from .config import resolve_hypers
from .errors import Loc, SpecError, did_you_mean
from .parser import parse_spec
from .layouts import as_rows, quantize, resolve_layout, rows_cols, storage_shape
from .reference import ParamCopy, initial_scalars, initial_values, plain_state

__all__ = ["load_spec", "builtin_names", "builtin_path", "init_state", "state_layout", "SpecLike"]

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


def _read_spec_file(path: Path, shown: str) -> str:
    """The text of a spec file: UTF-8, line ends made '\\n' (as Python's text mode does).

    Raises:
        SpecError: the bytes are not UTF-8 (located at the first bad byte, `shown` as the file's name).
        OSError: the file cannot be read.
    """
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        before = _newlines(data[: err.start].decode("utf-8"))
        line = before.count("\n") + 1
        col = len(before) - (before.rfind("\n") + 1) + 1
        byte = f"byte 0x{data[err.start]:02x}"
        why = {"invalid start byte": f"{byte} cannot start a character",
               "invalid continuation byte": f"{byte} starts a character that the bytes after it do not continue",
               "unexpected end of data": f"the file ends inside the character that {byte} starts"}
        raise SpecError(
            f"the file is not UTF-8: {why.get(err.reason, f'{err.reason} at {byte}')}",
            Loc(shown, line, col, line, col + 1),
            _newlines(data.decode("utf-8", errors="replace")),
            hint="save the spec as UTF-8",
        ) from None
    return _newlines(text)


def _newlines(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


@functools.lru_cache(maxsize=128)
def _load_text(source: str, path: str) -> ir.Spec:
    return check_spec(parse_spec(source, path))


def load_spec(spec: SpecLike) -> ir.Spec:
    """Parse and check a spec.

    Args:
        spec: a built-in name such as "adamw", a path to a `.fopt` file, or an `ir.Spec`
            (returned as is).

    Raises:
        SpecError: the spec has a problem (printed as `path:line:col: message`), its file
            not UTF-8 included.
        FileNotFoundError: no such built-in name or file.
        OSError: the file cannot be read.
    """
    if isinstance(spec, ir.Spec):
        return spec
    text = os.fspath(spec)
    if text.endswith(".fopt") or os.sep in text or "/" in text:
        path = Path(text)
        if not path.is_file():
            raise FileNotFoundError(f"no spec file at '{text}'")
        return _load_text(_read_spec_file(path, text), text)
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
    shown = f"optimizers/{text}.fopt"
    return _load_text(_read_spec_file(path, shown), shown)


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
            (`forge_dsl.layouts`). States that must stay exact
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
            why = "it is declared exact" if state.exact else "it starts from param (it holds weight-like values)"
            raise ValueError(
                f"state '{state.name}' of {spec.name} must stay in fp32 because {why}, but the layout asks for "
                f"{choice!r}; leave it out of the layout dict (it then stays fp32)"
            )
        return choice
    return "fp32" if state.must_stay_exact else layout
