"""What a `ForgeOptimizer.state_dict()` holds beyond torch's, and the checks its `load_state_dict` runs.

    sd = opt.state_dict()
    sd["param_groups"][i]["_forge"]   # {"format": 1, "spec": "adamw", "spec_hash": "3f2c...", "state_dtype": "int8",
                                      #  "rounding": "stochastic", "seed": 0, "without_state": [[1, 2]]}
    sd["state"][j]                    # {"exp_avg": int8 [N, K], "exp_avg.scale": float32 [N, ceil(K / 64)],
                                      #  "exp_avg_sq": uint8 [N, K], "exp_avg_sq.scale": float32 [N, ceil(K / 64)],
                                      #  "step": float64 [], "seed": int64 [], <scalar states>: float64 []}
                                      # (state_dtype "int4": "exp_avg" int8 [N, K / 2], "exp_avg_sq" uint8
                                      #  [N, K / 2], two 4-bit codes a byte, the same scales)

Where the metadata lives, and why: in every param group. torch.distributed.checkpoint keeps an optimizer's
"state" and "param_groups" and nothing else: `get_optimizer_state_dict` rebuilds the dict from those two (a
top-level key is dropped), and with `flatten_optimizer_state_dict=True` it keeps the param-group keys that the
live optimizer's groups have (a ForgeOptimizer's groups get the entry when their first state is made).
`dcp.load` reads a checkpoint into the tensors of the state dict it is handed, so int8 state loaded into an
fp32 optimizer arrives as int8 codes cast to float32 and without its scales; the metadata, loaded as saved,
says what each state must be, and `check_state_dict` refuses such a dict instead of training on it. (dcp.load
writes into the tensors `get_optimizer_state_dict` returned, which are the optimizer's own: after such a
refusal its state is overwritten, and a new optimizer is needed; a refusal of `load_state_dict` itself
changes nothing.)

`check_state_dict` checks everything before the optimizer changes: the metadata (format, spec name and hash,
layouts, rounding, seed), each param group's hyperparameters, and for every parameter's state: its entries
(the states its group's flags create, their int8 scales, `step`, `seed`, the scalar states, nothing else),
each state's dtype against the layout it was saved with (`forge_dsl.api.state_layout`,
`forge_dsl.kernels.layouts.resolve_layout`), its shape against the parameter's, `step` and `seed` whole numbers.

A parameter without state (never stepped) has no entry in "state", as in torch's state dicts; an entry lost
after saving looks the same. The metadata tells them apart: "without_state" lists, as [group, position in the
group], the parameters the saving optimizer had no state for (`without_state`); a parameter missing from
"state" and not listed is refused (or, with `strict=False`, starts from fresh state and is named in
`Loaded.lost`). A dict whose metadata has no list (written before it) cannot tell, and loads as it did.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import torch

from ..api import state_layout
from ..kernels.checks import ROUNDINGS
from ..kernels.layouts import (
    FOUR_BIT_LAYOUTS,
    SCALE_DTYPES,
    StateLayout,
    is_quantized,
    layout_of,
    n_blocks,
    resolve_layout,
    rows_cols,
    storage_dtype,
    storage_shape,
)
from ..reference import initial_values
from ..spec import ir
from ..spec.keywords import check_seed, resolve_hypers
from ..spec.phases import extent_size
from ..spec.printer import print_spec

__all__ = ["META_KEY", "FORMAT", "STEP_DTYPE", "metadata", "without_state", "check_state_dict", "Loaded",
           "spec_digest", "held_layouts"]

# The param-group key of the metadata. A leading underscore: no spec keyword can be named so (checker.check_name).
META_KEY = "_forge"
FORMAT = 1  # raised when what a state dict holds changes meaning
# The dtype of each state's `step` counter: exact to 2**53, where torch.optim's float32 stops counting at 2**24.
# torch's load_state_dict keeps a step tensor's dtype (but for fused or capturable groups), so torch's AdamW
# loads these states and counts on in float64; a float32 step (torch's, FORGE's before) loads as float64.
STEP_DTYPE = torch.float64



_SCALE_WORDS = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def spec_digest(spec: ir.Spec) -> str:
    """A hash of the spec's canonical text (`print_spec`: comments and formatting do not change it)."""
    return hashlib.sha256(print_spec(spec).encode()).hexdigest()[:16]


def metadata(spec: ir.Spec, state_dtype: Union[str, Mapping[str, str]], rounding: str, seed: int) -> dict:
    """A fresh metadata dict (each param group gets its own: a caller may edit one)."""
    return {"format": FORMAT, "spec": spec.name, "spec_hash": spec_digest(spec),
            "state_dtype": dict(state_dtype) if isinstance(state_dtype, Mapping) else state_dtype,
            "rounding": rounding, "seed": int(seed)}


def without_state(param_groups: Sequence[Mapping[str, Any]], state: Mapping) -> list[list[int]]:
    """[group, position in the group] of each parameter of `param_groups` that has no state (or an empty one) in
    `state`: the metadata's "without_state" entry (module docstring)."""
    return [[i, j] for i, group in enumerate(param_groups) for j, p in enumerate(group["params"])
            if not state.get(p)]


@dataclass(frozen=True)
class Loaded:
    """A checked state dict, ready to replace an optimizer's state (nothing of the optimizer changed yet).

    Attributes:
        meta: the metadata (`metadata`'s keys), as saved.
        states: each parameter's new state (per-element states and scales on the parameter's device;
            `step` `STEP_DTYPE`, `seed` int64 and scalar states float64, 0-dim, on the CPU), copies.
        groups: per param group, the saved entries to set in it (`params` left out, the metadata in).
        lost: how messages name the parameters whose entries were lost after saving (`strict=False` only):
            they start from fresh state.
    """

    meta: dict
    states: dict
    groups: list
    lost: list


def check_state_dict(spec: ir.Spec, state_dict: Any, param_groups: Sequence[Mapping[str, Any]],
                     keywords: Iterable[str], names: Mapping[torch.Tensor, str], strict: bool = True) -> Loaded:
    """Check `state_dict` against an optimizer of `spec` with `param_groups`; see the module docstring.

    Args:
        spec: the optimizer's spec.
        state_dict: what was handed to `load_state_dict`.
        param_groups: the optimizer's live groups (`params`, the spec's keywords, ...).
        keywords: the spec's keyword names (what a param group's hyperparameters are).
        names: parameter names, for messages.
        strict: refuse a parameter whose entry was lost after saving (False: name it in `Loaded.lost`).

    Raises:
        TypeError: `state_dict` is not a mapping with "state" and "param_groups".
        ValueError: anything else that does not match, with what to do.
    """
    if not isinstance(state_dict, Mapping) or "state" not in state_dict or "param_groups" not in state_dict:
        raise TypeError("load_state_dict expects a dict with 'state' and 'param_groups' (what "
                        f"ForgeOptimizer.state_dict() returns), got {type(state_dict).__name__}")
    saved_groups, saved_state = state_dict["param_groups"], state_dict["state"]
    meta = _find_metadata(spec, state_dict, saved_groups)
    if len(saved_groups) != len(param_groups) or any(
        len(a["params"]) != len(b["params"]) for a, b in zip(saved_groups, param_groups)
    ):
        raise ValueError("state_dict has a different number of param groups or parameters per group: "
                         f"{[len(g['params']) for g in saved_groups]} saved, "
                         f"{[len(g['params']) for g in param_groups]} here")
    state_dtype = meta["state_dtype"]
    keywords = frozenset(keywords)

    where: dict[Any, tuple[torch.Tensor, int]] = {}  # saved id -> (parameter, group index)
    for i, (sg, g) in enumerate(zip(saved_groups, param_groups)):
        for old, p in zip(sg["params"], g["params"]):
            where[old] = (p, i)
    lost = _lost_entries(meta, saved_groups, param_groups, saved_state, names)
    if lost and strict:
        raise ValueError(
            f"state_dict has no state for {', '.join(lost)}, which the optimizer that saved it had stepped (its FORGE "
            f"metadata lists the parameters it saved without state, and not {'these' if len(lost) > 1 else 'this one'})"
            ": the entries were dropped after saving, and loading would restart them at step 1 with fresh state. "
            "Load the whole dict that ForgeOptimizer.state_dict() wrote, or call "
            "optimizer.load_state_dict(state_dict, strict=False) to start them from fresh state (it warns)"
        )
    group_states: list[Optional[frozenset]] = [None] * len(param_groups)
    states: dict = {}
    for old, values in saved_state.items():
        if old not in where:
            raise ValueError(f"state_dict has state for parameter {old!r}, which none of its param groups lists")
        p, i = where[old]
        if group_states[i] is None:
            group_states[i] = _created_states(spec, {**param_groups[i], **saved_groups[i]}, keywords, i)
        states[p] = _checked_state(spec, values, p, _label(p, old, i, names), group_states[i], state_dtype)

    groups = []
    for sg in saved_groups:
        values = {k: v for k, v in sg.items() if k != "params"}
        values[META_KEY] = metadata(spec, state_dtype, meta["rounding"], meta["seed"])
        groups.append(values)
    return Loaded(meta, states, groups, lost)


def _label(p: torch.Tensor, saved_id: Any, group: int, names: Mapping[torch.Tensor, str]) -> str:
    return f"parameter '{names[p]}'" if p in names else f"parameter {saved_id!r} (group {group})"


def _lost_entries(meta: Mapping[str, Any], saved_groups: Sequence[Mapping], param_groups: Sequence[Mapping],
                  saved_state: Mapping, names: Mapping[torch.Tensor, str]) -> list[str]:
    """The parameters missing from "state" that the metadata's "without_state" does not list (module docstring),
    as messages name them; none where the metadata has no list."""
    listed = meta.get("without_state")
    if listed is None:
        return []
    try:
        stateless = {(int(i), int(j)) for i, j in listed}
    except (TypeError, ValueError):
        raise ValueError(f"state_dict's FORGE metadata has without_state {listed!r}; expected a list of "
                         "[group, position] pairs, as ForgeOptimizer.state_dict() writes") from None
    return [_label(p, old, i, names)
            for i, (sg, g) in enumerate(zip(saved_groups, param_groups))
            for j, (old, p) in enumerate(zip(sg["params"], g["params"]))
            if old not in saved_state and (i, j) not in stateless]


def _find_metadata(spec: ir.Spec, state_dict: Mapping[str, Any], saved_groups: Sequence[Mapping]) -> dict:
    """The metadata of `state_dict`, checked: its param groups' (all equal), else the top-level "forge" entry
    that state dicts had before it moved into the groups."""
    found = [g[META_KEY] for g in saved_groups if META_KEY in g]
    if found:
        meta = found[0]
        if any(m != meta for m in found):
            raise ValueError(f"state_dict's param groups disagree on their '{META_KEY}' entries (what their states "
                             "are); each ForgeOptimizer.state_dict() writes the same one in every group")
    elif isinstance(state_dict.get("forge"), Mapping):
        meta = dict(state_dict["forge"])
    else:
        raise ValueError(_foreign_message(spec, state_dict))
    if not isinstance(meta, Mapping):
        raise ValueError(f"state_dict's '{META_KEY}' entry is a {type(meta).__name__}, not the dict that "
                         "ForgeOptimizer.state_dict() writes")
    meta = dict(meta)
    fmt = meta.get("format", FORMAT)
    if fmt != FORMAT:
        raise ValueError(f"state_dict was written in FORGE state-dict format {fmt!r}, this forge_dsl reads format "
                         f"{FORMAT}: load it with the forge_dsl version that saved it")
    for key in ("spec", "state_dtype", "rounding", "seed"):
        if key not in meta:
            raise ValueError(f"state_dict's FORGE metadata has no '{key}'; it is not one ForgeOptimizer.state_dict() "
                             "wrote")
    if meta["spec"] != spec.name:
        raise ValueError(f"state_dict is for optimizer '{meta['spec']}', this one runs '{spec.name}': their states "
                         f"mean different things. Load it into a ForgeOptimizer running '{meta['spec']}', or start "
                         f"this one from fresh state (load only the model's weights)")
    digest = spec_digest(spec)
    if "spec_hash" in meta and meta["spec_hash"] != digest:
        raise ValueError(
            f"state_dict was saved by another version of the spec '{spec.name}' (spec hash {meta['spec_hash']}, this "
            f"one's is {digest}): its states may mean something else now. Load it with the spec that saved it; if "
            f"you changed the spec on purpose and its states keep their meaning, delete 'spec_hash' from each param "
            f"group's '{META_KEY}' entry before loading"
        )
    if meta["rounding"] not in ROUNDINGS:
        raise ValueError(f"state_dict's FORGE metadata has rounding {meta['rounding']!r}; expected one of "
                         f"{ROUNDINGS}")
    try:
        meta["seed"] = check_seed(meta["seed"], "state_dict's FORGE metadata seed")
    except TypeError as err:
        raise ValueError(str(err)) from None
    layout = meta["state_dtype"] = dict(meta["state_dtype"]) if isinstance(meta["state_dtype"], Mapping) \
        else meta["state_dtype"]
    if not isinstance(layout, (str, Mapping)):
        raise ValueError(f"state_dict's FORGE metadata has state_dtype {layout!r}; expected a layout name or a "
                         "dict of them per state")
    try:
        for s in spec.states:
            resolve_layout(state_layout(spec, s, layout), s.nonneg, (1, 64))
    except ValueError as err:
        raise ValueError(f"state_dict's FORGE metadata has state_dtype {layout!r}: {err}") from None
    return meta


def _foreign_message(spec: ir.Spec, state_dict: Mapping[str, Any]) -> str:
    entries = sorted({k for values in state_dict["state"].values() if isinstance(values, Mapping) for k in values})
    looks = ""
    if "step" in entries and "seed" not in entries:
        looks = (f"; its states hold {', '.join(map(str, entries))} and no rounding seed: it looks like a "
                 "torch.optim optimizer's")
    return (
        f"state_dict has no FORGE metadata (the '{META_KEY}' entry that ForgeOptimizer.state_dict() writes in each "
        f"param group), so its states cannot be checked against {spec.name}'s layouts and would be misread{looks}. "
        f"Load a state_dict that a ForgeOptimizer running '{spec.name}' saved (torch.save of opt.state_dict(), or "
        "torch.distributed.checkpoint's get_optimizer_state_dict / set_optimizer_state_dict, which keep the entry), "
        "or start this optimizer from fresh state: load only the model's weights and skip the optimizer's "
        "load_state_dict (Hugging Face Trainer: resume from a checkpoint folder without optimizer.pt)"
    )


def _created_states(spec: ir.Spec, group: Mapping[str, Any], keywords: frozenset, index: int) -> frozenset:
    """The states `init_state` creates for a param group's flags (checking its hyperparameters on the way)."""
    hypers = {k: v for k, v in group.items() if k in keywords and v is not None}
    try:
        cfg = resolve_hypers(spec, hypers, caller="load_state_dict")
    except (TypeError, ValueError) as err:
        raise ValueError(f"state_dict's param group {index}: {err}") from None
    return frozenset(initial_values(spec, cfg))


def _checked_state(spec: ir.Spec, values: Any, p: torch.Tensor, label: str, created: frozenset,
                   state_dtype: Union[str, Mapping[str, str]]) -> dict:
    """One parameter's saved state, checked and copied to where `init_state` keeps each entry."""
    if not isinstance(values, Mapping):
        raise ValueError(f"state_dict's state of {label} is a {type(values).__name__}, not a dict of tensors")
    rows, cols = rows_cols(p.shape)
    out: dict[str, torch.Tensor] = {}
    expected = set()
    for s in spec.states:
        if s.name not in values:
            if s.name in created:
                raise ValueError(f"state_dict's state of {label} has no '{s.name}', which {spec.name} keeps with its "
                                 "param group's flags; it is not a whole ForgeOptimizer state")
            continue
        layout = resolve_layout(state_layout(spec, s, state_dtype), s.nonneg, p.shape)
        t = _tensor(values[s.name], f"'{s.name}' of {label}")
        want = storage_dtype(layout)
        scale_name = f"{s.name}.scale"
        if t.dtype != want:
            raise ValueError(
                f"state_dict's '{s.name}' of {label} is {t.dtype}, but the layout it was saved with (state_dtype "
                f"{state_dtype!r}) stores it as {_storage_words(layout, scale_name, rows, cols)}: it was converted "
                f"after saving (a cast or a view), or torch.distributed.checkpoint's dcp.load read it into this "
                f"optimizer's own state (dcp.load keeps the dtypes of the state dict it is given). Construct the "
                f"optimizer with state_dtype={state_dtype!r}, as the one that saved it, before loading"
            )
        want_shape = storage_shape(layout, p.shape) if s.extent is None else (extent_size(p.shape, s.extent),)
        if tuple(t.shape) != want_shape:
            packed = (f" (int4 codes, two a byte: {want_shape})" if layout in FOUR_BIT_LAYOUTS else
                      f" (one value per {s.unit}: {want_shape})" if s.extent is not None else "")
            raise ValueError(f"state_dict's '{s.name}' of {label} has shape {tuple(t.shape)}, the parameter "
                             f"{tuple(p.shape)}{packed}: the state dict is for another model, or its parameters are "
                             "in another order")
        out[s.name] = t.to(p.device, copy=True)
        expected.add(s.name)
        if is_quantized(layout):
            if scale_name not in values:
                raise ValueError(f"state_dict's {layout.layout_name} '{s.name}' of {label} has no '{scale_name}' "
                                 "(its block scales): the codes cannot be read without them")
            scale = _tensor(values[scale_name], f"'{scale_name}' of {label}")
            if scale.dtype not in SCALE_DTYPES or tuple(scale.shape) != (rows, n_blocks(cols)):
                raise ValueError(f"state_dict's '{scale_name}' of {label} is {scale.dtype} of shape "
                                 f"{tuple(scale.shape)}; {layout.layout_name} '{s.name}' needs float32 or bfloat16 of "
                                 f"shape ({rows}, {n_blocks(cols)}) (one scale per 64 elements of a row)")
            out[scale_name] = scale.to(p.device, copy=True)
            expected.add(scale_name)
    for s in spec.scalars:
        if s.name not in values:
            raise ValueError(f"state_dict's state of {label} has no scalar state '{s.name}'; it is not a whole "
                             "ForgeOptimizer state")
        out[s.name] = _number(values[s.name], f"scalar state '{s.name}' of {label}", torch.float64)
        expected.add(s.name)
    for key in ("step", "seed"):
        if key not in values:
            raise ValueError(f"state_dict's state of {label} has no '{key}'; a ForgeOptimizer state keeps its step "
                             "count and rounding seed beside its states")
    out["step"] = _number(values["step"], f"step of {label}", STEP_DTYPE)
    step = float(out["step"])
    if not (step >= 0 and step == int(step) and step != float("inf")):
        raise ValueError(f"state_dict's step of {label} is {step}; a step count is a whole number, at least 0")
    seed = values["seed"]
    try:
        seed = check_seed(seed.item() if isinstance(seed, torch.Tensor) and seed.numel() == 1 else seed,
                          f"state_dict's seed of {label}")
    except TypeError as err:
        raise ValueError(str(err)) from None
    out["seed"] = torch.tensor(seed, dtype=torch.int64)
    unknown = sorted(map(str, set(values) - expected - {"step", "seed"}))
    if unknown:
        raise ValueError(f"state_dict's state of {label} has entries {unknown} that {spec.name} with state_dtype "
                         f"{state_dtype!r} does not keep (its states: {', '.join(spec.state_names) or 'none'})")
    return out


def _storage_words(layout: StateLayout, scale_name: str, rows: int, cols: int) -> str:
    if is_quantized(layout):
        return f"{layout.storage_words} with a float32 or bfloat16 '{scale_name}' of shape ({rows}, {n_blocks(cols)})"
    return layout.storage_words


def _tensor(value: Any, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"state_dict's {what} is a {type(value).__name__}, not a tensor")
    if value.is_meta:
        raise ValueError(f"state_dict's {what} is a meta tensor (it has no data)")
    return value


def _number(value: Any, what: str, dtype: torch.dtype) -> torch.Tensor:
    """A one-element tensor or a real number → a 0-dim CPU tensor of `dtype`."""
    if isinstance(value, torch.Tensor):
        _tensor(value, what)
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"state_dict's {what} is a {value.dtype} tensor of shape {tuple(value.shape)}; "
                             "expected one real number")
        return value.detach().reshape(()).to("cpu", dtype, copy=True)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"state_dict's {what} is {value!r}; expected a number")
    return torch.tensor(float(value), dtype=dtype)


def held_layouts(spec: ir.Spec, states: Iterable[Mapping[str, Any]]) -> Optional[str]:
    """The layouts that `states` (one dict per parameter) hold, for `ForgeOptimizer.describe`: "int8 (bf16
    scales)" when every state of every parameter has one layout (quantized ones name their block scales' dtype:
    fp32 in checkpoints from before bf16 scales), else per state with counts ("exp_avg int8 (bf16 scales) ×3,
    fp32 ×2; exp_avg_sq uint8 (sqrt map, bf16 scales) ×3, ..."); None when no parameter has state yet."""
    counts: dict[str, dict[str, int]] = {s.name: {} for s in spec.states}
    for state in states:
        for s in spec.states:
            t = state.get(s.name)
            if isinstance(t, torch.Tensor):
                scale = state.get(f"{s.name}.scale")
                scale = scale if isinstance(scale, torch.Tensor) else None
                layout = layout_of(t, scale=scale)
                word = layout.words if layout is not None else str(t.dtype)
                if scale is not None and scale.dtype in _SCALE_WORDS:  # "int8 (bf16 scales)", "uint4 (..., bf16 ...)"
                    scales = f"{_SCALE_WORDS[scale.dtype]} scales"
                    word = f"{word[:-1]}, {scales})" if word.endswith(")") else f"{word} ({scales})"
                counts[s.name][word] = counts[s.name].get(word, 0) + 1
    counts = {name: c for name, c in counts.items() if c}
    if not counts:
        return None
    words = {w for c in counts.values() for w in c}
    if len(words) == 1:
        return words.pop()
    return "; ".join(f"{name} " + ", ".join(f"{w} ×{n}" for w, n in c.items()) for name, c in counts.items())
