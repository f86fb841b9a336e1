"""One element-wise step launch for many small parameters (torch.optim's `foreach`).

Stepping a model's norm weights one by one costs a launch and its argument checks each, host time
of the order of v9c's 0.18 ms per linear layer's call for a few thousand elements: a Llama-3.1-8B
has 65 of them. `foreach_step` copies the parameters, gradients and states of a list into flat
buffers, runs the spec's element-wise kernel once over them, and copies the new weights and states
back: a handful of launches whatever the list's length. Measured (docs/PERF.md v10b): level at
1 × 2048 tokens (presumably the GPU still has backward's work queued while `step()` runs); medians
6–9 % lower at 1 × 512, inside that run's spread.

    keys = [shared_launch_key(spec, p, p.grad, state[p]) for p in params]   # equal keys: one launch
    foreach_step(spec, params, [p.grad for p in params], [state[p] for p in params], step=t, **hypers)

Exactness: the update is element-wise, so every element gets the update `step` would give it
on its own parameter. With `rounding="nearest"` the results are the same bits in the Triton
interpreter; on the GPU the flat launch runs another specialization of the compiled kernel, which
may contract another `a * b + c` into an FMA (a unit in the last place; tests/kernels/test_foreach.py).
Two more things make it hold or bound it:
  * int8 and int4 states are quantized in blocks of 64 consecutive elements of a row
    (`forge_dsl.kernels.layouts`); the flat buffer's blocks (and int4's bytes of two codes) are the
    parameters' own only when every parameter's last dimension is a multiple of 64, so
    `shared_launch_key` returns None for any other parameter with quantized state;
  * stochastic rounding draws its bits from `seed` and each element's offset in the flat
    buffer: the same distribution as separate launches, not the same bits.
"""

from __future__ import annotations

from typing import Any, Hashable, MutableMapping, Optional, Sequence

import torch

from ..spec.loading import SpecLike, load_spec
from ..compiler.loader import compiled_variants
from .checks import DEFAULT_ROUNDING, DEFAULT_SEED, check_state, check_state_kind
from .layouts import BLOCK, as_rows, holds_codes, layout_of, n_blocks, storage_shape
from .steps import resolved_hypers
from .steps import step as elementwise_step

__all__ = ["FOREACH_MAX_ELEMENTS", "foreach_step", "shared_launch_key"]

# Parameters up to this size share launches in `ForgeOptimizer.step` (norm weights, biases). A
# larger one pays its own launch anyway in copies (the flat buffers double its traffic), and
# holds its own GPU time, so its launch's host time is not what the GPU waits for.
FOREACH_MAX_ELEMENTS = 1 << 20

# Widths tried for the flat buffers' rows ([rows, width], row-major): a multiple of 64 keeps the
# int8 blocks where they were, and wide rows fill the element-wise kernel's 8 × 256 tiles.
_ROW_WIDTHS = (4096, 1024, 256, 64)


def _state_tensors(spec, state: MutableMapping[str, Any]) -> list[str]:
    """Names in `state` of the spec's per-element states and their int8 block scales, in spec order."""
    names = []
    for s in spec.states:
        if s.name in state:
            names.append(s.name)
            if f"{s.name}.scale" in state:
                names.append(f"{s.name}.scale")
    return names


def shared_launch_key(spec: SpecLike, param: torch.Tensor, grad: torch.Tensor,
                      state: MutableMapping[str, Any]) -> Optional[Hashable]:
    """A key such that parameters with equal keys can be stepped by one `foreach_step` (same device,
    dtypes, state names and layouts, scalar-state values); None when `param` cannot share a launch
    (int8 state with a last dimension not a multiple of 64, or a non-contiguous parameter)."""
    spec = load_spec(spec)
    if not param.is_contiguous():
        return None
    names = _state_tensors(spec, state)
    quantized = any(holds_codes(state[n]) for n in names if not n.endswith(".scale"))
    if quantized and as_rows(param).shape[1] % BLOCK:
        return None
    scalars = tuple(float(state[s.name]) for s in spec.scalars if s.name in state)
    layouts = tuple((n, state[n].dtype, n.endswith(".scale") or layout_of(state[n], param.shape)) for n in names)
    return (param.device, param.dtype, grad.dtype, layouts, scalars)


def _check_one(spec, i: int, param: torch.Tensor, grad: torch.Tensor, state: MutableMapping[str, Any],
               names: tuple[str, ...]) -> None:
    """Shapes and devices of `grads[i]` and `states[i]` against `params[i]`: the flat buffers concatenate
    them in order, so a state of another shape would be updated against other elements' gradients; and each
    state the variant reads (`names`) against what the spec's state needs (`checks.check_state`), named
    `states[i]['NAME']`, since the flat launch's own check sees only the concatenation."""
    if grad.shape != param.shape:
        raise ValueError(f"grads[{i}] has shape {tuple(grad.shape)} but params[{i}] has {tuple(param.shape)}; "
                         "they must match")
    for name in names:
        if name not in state:
            raise ValueError(f"states[{i}] has no '{name}', which {spec.name} needs with these flags; create it with "
                             f"forge_dsl.init_state(spec, params[{i}], layout=..., **hypers) using the same flags")
        check_state_kind(spec, name, state, param.shape, what=f"states[{i}]['{name}']")
    rows, cols = as_rows(param).shape
    for name in _state_tensors(spec, state):
        t = state[name]
        layout = None if name.endswith(".scale") else layout_of(t, param.shape)
        if name.endswith(".scale"):
            want = (rows, n_blocks(cols))
        else:  # the parameter's shape; int4 codes its last dim halved (an unknown dtype: the launch says so)
            want = tuple(param.shape) if layout is None else storage_shape(layout, param.shape)
        if tuple(t.shape) != want:
            raise ValueError(f"states[{i}]['{name}'] has shape {tuple(t.shape)} but params[{i}] of shape "
                             f"{tuple(param.shape)} needs {want}; create it with "
                             f"forge_dsl.init_state(spec, params[{i}])")
    for what, t in [(f"grads[{i}]", grad)] + [(f"states[{i}]['{n}']", state[n]) for n in _state_tensors(spec, state)]:
        if t.device != param.device:
            raise ValueError(f"{what} is on {t.device} but params[{i}] is on {param.device}")
    for name in names:
        check_state(spec, name, state, param, what=f"states[{i}]['{name}']")


def _flat_width(total: int) -> int:
    """Row width of a flat buffer of `total` elements (see _ROW_WIDTHS); 0 for one row of all."""
    for width in _ROW_WIDTHS:
        if total % width == 0:
            return width
    return 0


def _flatten(tensors: Sequence[torch.Tensor], rows: int) -> torch.Tensor:
    flat = torch.cat([t.reshape(-1) for t in tensors])
    return flat.reshape(rows, -1) if rows else flat


def _scatter(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive pieces of `flat` back into `tensors` (contiguous), in one launch."""
    pieces = flat.reshape(-1).split([t.numel() for t in tensors])
    torch._foreach_copy_([t.view(-1) for t in tensors], list(pieces))


def foreach_step(
    spec: SpecLike,
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    states: Sequence[MutableMapping[str, Any]],
    *,
    step: int,
    seed: int = DEFAULT_SEED,
    rounding: str = DEFAULT_ROUNDING,
    **hypers: Any,
) -> None:
    """Update every `params[i]` and `states[i]` in place from `grads[i]`, in one element-wise launch.

    Args:
        spec: built-in name, path to a `.fopt`, or loaded spec.
        params: contiguous tensors, any shapes; `shared_launch_key` equal (and not None) for all.
        grads: one per parameter, same shape and dtype rules as `forge_dsl.kernels.step`.
        states: one per parameter, from `forge_dsl.init_state`; their scalar states must agree
            (they are part of the key) and are all set to the one new value.
        step, seed, rounding, **hypers: as for `forge_dsl.kernels.step` (`seed` draws the
            stochastic rounding of all of them).

    Raises:
        ValueError: lists of different lengths, a grad or state of another shape or device than its
            parameter, or parameters that cannot share a launch.
    """
    spec = load_spec(spec)
    if not (len(params) == len(grads) == len(states)):
        raise ValueError(f"foreach_step needs one grad and one state per param, got {len(params)} params, "
                         f"{len(grads)} grads and {len(states)} states")
    if not params:
        return
    names = compiled_variants(spec)[resolved_hypers(spec, hypers).variant].states
    for i, (p, g, s) in enumerate(zip(params, grads, states)):
        _check_one(spec, i, p, g, s, names)
    keys = [shared_launch_key(spec, p, g, s) for p, g, s in zip(params, grads, states)]
    if keys[0] is None or any(k != keys[0] for k in keys):
        bad = next(i for i, k in enumerate(keys) if k is None or k != keys[0])
        raise ValueError(
            f"params[{bad}] cannot share a launch with params[0]: they need the same device, dtypes, state "
            "layouts and scalar-state values, contiguous params and, with int8 state, a last dimension that is "
            "a multiple of 64 (group them by forge_dsl.kernels.foreach.shared_launch_key)"
        )
    _step_flat(spec, params, grads, states, step=step, seed=seed, rounding=rounding, **hypers)


def _step_flat(spec, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
               states: Sequence[MutableMapping[str, Any]], *, step: int, seed: int, rounding: str,
               **hypers: Any) -> None:
    """`foreach_step` for a loaded spec and parameters already checked to share a launch (equal
    `shared_launch_key`s, as `ForgeOptimizer.step` groups them): flatten, one launch, copy back."""
    if len(params) == 1:
        elementwise_step(spec, params[0], grads[0], states[0], step=step, seed=seed, rounding=rounding, **hypers)
        return

    total = sum(p.numel() for p in params)
    width = _flat_width(total)
    rows = total // width if width else 0
    flat_param = _flatten(params, rows)
    flat_grad = _flatten(grads, rows)
    names = _state_tensors(spec, states[0])
    flat_state: dict[str, torch.Tensor] = {}
    for name in names:
        # a scale has one element per 64 of its state: its flat rows are the state's rows
        flat_state[name] = _flatten([s[name] for s in states], rows)
    for s in spec.scalars:
        if s.name in states[0]:
            flat_state[s.name] = states[0][s.name].clone()

    elementwise_step(spec, flat_param, flat_grad, flat_state, step=step, seed=seed, rounding=rounding, **hypers)

    _scatter(flat_param, params)
    for name in names:  # one copy launch per kind of tensor (mixed dtypes would take torch's slow path)
        _scatter(flat_state[name], [s[name] for s in states])
    for s in spec.scalars:
        if s.name in states[0]:
            for state in states:
                state[s.name].copy_(flat_state[s.name])
