"""Host side of the generated kernels: the entry points, which check, bind and launch (one module each).

    fused_linear_step(spec, x, dy, weight, state, step=t, **hypers)
        x [..., K] and dy [..., N] of one linear layer y = x Wᵀ; weight [N, K] and
        its state updated in place from dW = dyᵀ x, which is never stored.
    slab_linear_step(spec, x, dy, weight, state, step=t, **hypers)
        the same, with dW from cuBLAS one L2-sized slab of rows at a time (never whole).
    linear_step(spec, x, dy, weight, state, step=t, path="auto", **hypers)
        whichever of the two `policy.auto_linear_path` picks.
    step(spec, param, grad, state, step=t, **hypers)
        the same update from a materialized gradient, for any parameter shape.
    ParamUpdate(spec, param, state, step=t, **hypers)
        one step of one parameter, launched on blocks of its rows (a fused LM head's vocabulary blocks).

`state` is what `forge_dsl.init_state(spec, param, layout=...)` returns. On a machine without CUDA,
tensors live on the CPU and the kernels run in the Triton interpreter (`TRITON_INTERPRET=1` must be set
before triton is imported). The path of a call: `checks` refuses what the kernels cannot run, `policy`
picks the tile config and the path, `ParamUpdate` binds the variant, its host scalars and the state once,
`kernel_calls` runs the kernels; a warp-specialized call whose metadata repeats a checked call's reuses that
call's launch (`reuse`), tried once per call in `_linear`.
"""

from __future__ import annotations

import math
from typing import Any, MutableMapping, Optional

import torch

from ..compiler.loader import compiled_variants
from ..spec.keywords import check_step, resolve_hypers
from ..spec.loading import SpecLike, load_spec
from . import reuse
from .checks import (
    DEFAULT_ROUNDING,
    DEFAULT_SEED,
    any_quantized,
    bind_states,
    check_config,
    check_device,
    check_linear,
    check_rounding,
    check_warp_specialized,
    tma_compatible,
    tma_readable,
    weight_view,
)
from .kernel_calls import device_guard, kernel_host_values, launch_elementwise, launch_fused, mix_seed
from .layouts import holds_codes
from .policy import (
    LINEAR_PATHS,
    WS_MIN_ELEMENTS,
    TileConfig,
    auto_linear_path,
    default_slab_bytes,
    fused_config,
    hopper_with_gluon,
    stored_bytes,
)
from .slabs import slab_grads

__all__ = ["fused_linear_step", "slab_linear_step", "linear_step", "step", "ParamUpdate", "TileConfig", "mix_seed",
           "launch_host_values", "resolved_hypers"]


class ParamUpdate:
    """One step of one parameter `param` [N, K] (any shape for `from_grad`) and its `state`, bound once: the
    spec's variant for these keywords, its host scalars from the scalar state, the checked state tensors.

        update = ParamUpdate(spec, weight, state, step=t, seed=s, **hypers)
        update.fused(x, dy_rows, rows=r0)   # rows [r0, r0 + R) from dW = dy_rowsᵀ x: x [..., K], dy_rows [..., R]
        update.from_grad(grad_rows, rows=r0)  # rows [r0, r0 + R) from grad_rows [R, K]
        update.commit()                     # the scalar state's new values, once, after the last block

    `rows=None` updates the whole parameter (dy [..., N], grad of `param`'s shape). Each block of rows draws
    its own stochastic-rounding bits: a function of (seed, step, the block's first row, element index in
    the block); the whole parameter's are those of (seed, step, element index). Blocks may come in any order;
    each row is updated once per step by whoever holds this object.

    `host_row`: a `host_table.HostTable` row the kernels read this step's host scalars and key from (what a CUDA
    graph replays), which the caller has staged with `launch_host_values`' values; whole-parameter updates only.
    """

    def __init__(self, spec: SpecLike, param: torch.Tensor, state: MutableMapping[str, torch.Tensor], *, step: int,
                 seed: int = DEFAULT_SEED, rounding: str = DEFAULT_ROUNDING, host_row: Optional[torch.Tensor] = None,
                 **hypers: Any) -> None:
        check_rounding(rounding)
        self.spec = load_spec(spec)
        self.param = param
        self.state = state
        self.rounding = rounding
        self.update, self.names, self.exports, self._scalar_updates = _variant(self.spec, hypers, step, state)
        self.states = bind_states(self.spec, self.names, state, param)
        self.key = mix_seed(seed, step)
        # what the kernels take as HOST and their HOST_IN_TABLE: the values, or the table row that holds them
        self.host_args = (self.exports, -1) if host_row is None else (host_row, len(self.exports))

    def fused(self, x: torch.Tensor, dy: torch.Tensor, rows: Optional[int] = None, *, tf32: bool = False,
              config: Optional[TileConfig] = None) -> None:
        """Update rows [rows, rows + dy.shape[-1]) of the weight (all rows: None) from dW = dyᵀ x with the fused
        kernel; `tf32` and `config` as for `fused_linear_step`."""
        weight, states, key = self._block(rows, dy.shape[-1] if dy.dim() else 0)
        x2, dy2 = check_linear(x, dy, weight, self.rounding)
        self._fused(x2, dy2, weight, states, key, tf32, config)

    def from_grad(self, grad: torch.Tensor, rows: Optional[int] = None) -> None:
        """Update rows [rows, rows + grad.shape[0]) of the 2-D parameter (all of it: None) from `grad`, of the
        block's shape, with the element-wise kernel."""
        if rows is None:
            param, states, key = self.param, self.states, self.key
        else:
            param, states, key = self._block(rows, grad.shape[0] if grad.dim() else 0)
        if grad.shape != param.shape:
            raise ValueError(f"grad has shape {tuple(grad.shape)} but the rows it updates have {tuple(param.shape)}")
        check_device(grad, "grad")
        if grad.device != param.device:
            raise ValueError(f"grad is on {grad.device} but param is on {param.device}")
        weight_view(grad, "grad")
        if param.numel():
            launch_elementwise(self.update, param, grad.contiguous(), states, self.host_args[0], key, self.rounding,
                               self.host_args[1])

    def commit(self) -> None:
        """Write the scalar state's new values (after the last block of this step)."""
        for name, value in self._scalar_updates.items():
            self.state[name].fill_(value)

    def _block(self, rows: Optional[int], count: int):
        """(the parameter's rows [rows, rows + count), their state arguments, their rounding key)."""
        if rows is None:
            return self.param, self.states, self.key
        if self.host_args[1] >= 0:
            raise ValueError("a launch table row holds the whole parameter's key: row blocks draw keys of their own")
        if self.param.dim() != 2:
            raise ValueError(f"row blocks need a 2-D parameter [N, K], got shape {tuple(self.param.shape)}")
        if isinstance(rows, bool) or not isinstance(rows, int) or not 0 <= rows <= rows + count <= self.param.shape[0]:
            raise ValueError(f"rows must be an int with [rows, rows + {count}) inside the parameter's "
                             f"{self.param.shape[0]} rows, got {rows!r}")
        return self.param[rows:rows + count], self.states.rows(rows, rows + count), mix_seed(self.key, rows)

    def _fused(self, x2: torch.Tensor, dy2: torch.Tensor, weight: torch.Tensor, states, key: int, tf32: bool,
               config: Optional[TileConfig]) -> Optional[tuple]:
        """The fused kernel on checked x [T, K], dy [T, N] and weight rows [N, K]; returns a warp-specialized
        launch's arguments (`kernel_calls.launch_fused`)."""
        N, K = weight.shape
        if N == 0 or K == 0:
            return None
        w_view, w_bf16 = weight_view(weight, "weight")
        quantized = any_quantized(states.layouts)
        tma_ok = tma_compatible(x2) and tma_compatible(dy2)
        cfg = config or fused_config(x2.shape[0], N, K, weight.device, quantized, x2.dtype, warp_specialize=tma_ok,
                                     stored_bytes=stored_bytes(w_bf16, states.layouts))
        check_config(cfg, quantized)
        if cfg.warp_specialized and config is not None:  # fused_config picks it only where it runs
            from .gluon_lib import fused_ws

            check_warp_specialized(fused_ws, x2, weight, tma_ok, cfg)
        with device_guard(weight):
            launched = launch_fused(cfg, x2, dy2, w_view, w_bf16, states, self.update, self.host_args[0], key,
                                    self.rounding, tf32, self.host_args[1])
        return None if launched is None else (cfg, launched)


def _variant(spec, hypers: dict, step: int, state):
    """(the variant's update function, the states it reads, its host scalars, the new scalar state) of one step."""
    cfg = resolved_hypers(spec, hypers)
    host, update, names = compiled_variants(spec)[cfg.variant]
    check_step(step)
    missing = [s.name for s in spec.scalars if s.name not in state]
    if missing:
        raise ValueError(f"state has no scalar state {missing}; create it with forge_dsl.init_state")
    exports, scalar_updates = _kernel_host(host)(cfg.host_inputs, int(step),
                                                 {s.name: float(state[s.name]) for s in spec.scalars})
    return update, names, exports, scalar_updates


_HOST_STEPS: dict = {}  # (host program, id(keywords), step, scalar state) -> (keywords, its result): `_kernel_host`
_HOST_STEPS_MAX = 64


def _kernel_host(host):
    """A variant's host program (float64) whose scalars come out as the kernels read them (`kernel_host_values`):
    every launch's, the reused ones' (`reuse.PreparedLaunch`) included. One step of a model runs it once for all
    the layers that share keywords, step and scalar state: the result is remembered for the keywords object
    itself (`resolved_hypers` hands every layer of a param group the same one; the entry holds it, so its id is
    not reused while remembered). The result is shared: read it only."""
    def rounded(hypers, step, scalars):
        key = (host, id(hypers), step, tuple((k, v, math.copysign(1.0, v)) for k, v in scalars.items()))
        hit = _HOST_STEPS.get(key)
        if hit is not None and hit[0] is hypers:
            return hit[1]
        exports, scalar_updates = host(hypers, step, scalars)
        result = kernel_host_values(exports), scalar_updates
        if len(_HOST_STEPS) >= _HOST_STEPS_MAX:
            _HOST_STEPS.clear()
        _HOST_STEPS[key] = (hypers, result)
        return result

    return rounded


_RESOLVED: dict = {}  # (id(spec), keywords) -> (spec, StepConfig): see resolved_hypers
_RESOLVED_MAX = 256


def resolved_hypers(spec, hypers: dict):
    """`resolve_hypers(spec, hypers)`, remembered for keywords of plain numbers, bools and tuples of numbers
    (a training loop passes the same ones every step, and resolving them took ~25 % of a call's host time,
    docs/PERF.md v9c); tensors (e.g. a tensor lr, which may change in place) are resolved every time. Only
    successes are remembered, so bad keywords raise on every call. The result is shared: read it only."""
    values = tuple(hypers.values())
    identity = (id(spec), tuple(hypers), tuple(map(id, values)))
    seen = _BY_IDENTITY.get(identity)
    if seen is not None and seen[0] is spec and all(a is b for a, b in zip(seen[1], values)):
        return seen[2]
    key = _hypers_key(hypers)
    if key is None:
        return resolve_hypers(spec, hypers)
    hit = _RESOLVED.get((id(spec), key))
    if hit is not None and hit[0] is spec:
        cfg = hit[1]
    else:
        cfg = resolve_hypers(spec, hypers)
        if len(_RESOLVED) >= _RESOLVED_MAX:
            _RESOLVED.clear()
        _RESOLVED[(id(spec), key)] = (spec, cfg)
    if all(_immutable(v) for v in values):
        if len(_BY_IDENTITY) >= _RESOLVED_MAX:
            _BY_IDENTITY.clear()
        _BY_IDENTITY[identity] = (spec, values, cfg)  # holds the values: their ids are not reused meanwhile
    return cfg


# (id(spec), keyword names, ids of their values) -> (spec, the values, StepConfig): a param group hands every
# layer the same value objects until a scheduler writes new ones, so `_hypers_key` (~15 calls) runs once for them
_BY_IDENTITY: dict = {}


def _immutable(v) -> bool:
    """Whether `v` cannot change while its identity stays: None, a bool, int, float, str or a tuple of them."""
    return v is None or type(v) in _IMMUTABLE or (type(v) is tuple and all(type(m) in _IMMUTABLE for m in v))


_IMMUTABLE = (bool, int, float, str)


def _hypers_key(hypers: dict) -> Optional[tuple]:
    """A hashable key that tells apart every two keyword sets `resolve_hypers` could treat differently
    (types, and the sign of a zero), or None where a value is not a plain number, bool, word, None or tuple of
    them."""
    def one(v):
        if v is None or type(v) in (bool, int, str):
            return (type(v).__name__, v)
        if type(v) is float:
            return ("float", v, math.copysign(1.0, v))
        if type(v) in (tuple, list):
            members = tuple(one(m) for m in v)
            return None if None in members else (type(v).__name__, members)
        return None

    items = []
    for name in sorted(hypers):
        k = one(hypers[name])
        if k is None:
            return None
        items.append((name, k))
    return tuple(items)


def fused_linear_step(
    spec: SpecLike,
    x: torch.Tensor,
    dy: torch.Tensor,
    weight: torch.Tensor,
    state: MutableMapping[str, torch.Tensor],
    *,
    step: int,
    seed: int = DEFAULT_SEED,
    rounding: str = DEFAULT_ROUNDING,
    tf32: bool = False,
    config: Optional[TileConfig] = None,
    **hypers: Any,
) -> None:
    """Update `weight` and `state` in place from dW = dyᵀ·x without storing dW.

    Args:
        spec: built-in name, path to a `.fopt`, or loaded spec.
        x: [..., K] the layer's input activations (float32 or bfloat16, any strides).
        dy: [..., N] the gradient of its output (same dtype and leading dims as x).
        weight: [N, K] contiguous float32 or bfloat16 weight of y = x · weightᵀ.
        state: from `forge_dsl.init_state(spec, weight, layout=...)`.
        step: 1-based step number.
        seed: stochastic-rounding seed; the bits depend only on (seed, step, element index).
        rounding: "stochastic" (default) or "nearest", for bfloat16 weights.
        tf32: use tf32 tensor-core products for float32 activations (default: exact ieee fp32).
        config: tile sizes (default: `fused_config`).
        **hypers: torch-style keywords of the spec.

    A warp-specialized call whose arguments' metadata (shapes, strides, dtypes, devices, 16-byte alignment,
    state tensors, the spec's variant) repeat a checked call's reuses that call's launch: the checks, the
    config and Triton's argument binding are skipped, the keywords still resolved (forge_dsl/kernels/reuse.py;
    a third to a half of the host time).
    """
    _linear(spec, x, dy, weight, state, step, seed, rounding, tf32, config, None, hypers, "fused")


def linear_step(spec: SpecLike, x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor,
                state: MutableMapping[str, torch.Tensor], *, step: int, seed: int = DEFAULT_SEED,
                rounding: str = DEFAULT_ROUNDING, path: str = "auto", tf32: bool = False,
                config: Optional[TileConfig] = None, slab_bytes: Optional[int] = None,
                host_row: Optional[torch.Tensor] = None, **hypers: Any) -> None:
    """`fused_linear_step` or `slab_linear_step`, whichever is faster for this layer on this device.

    path "auto": what `policy.auto_linear_path` decides for these arguments; "fused" / "slab" force one. The
    slab's dW is rounded to bf16, as autograd's is, and float32 products there follow torch's matmul
    precision instead of `tf32`; the fused kernel keeps dW in fp32. `config` goes to the fused kernel,
    `slab_bytes` to the slab path (default: by state layout, see `slab_linear_step`); other arguments as
    for `fused_linear_step`, whose reused launches skip the path decision too.

    `host_row`: the fused kernel reads its host scalars and key from this `host_table.HostTable` row (staged
    by the caller with `launch_host_values`), so that a CUDA graph replays it with each step's values; the
    fused kernel only (`path` "auto" takes it), every call checked.
    """
    if path not in LINEAR_PATHS:
        raise ValueError(f"path must be one of {', '.join(LINEAR_PATHS)}, got {path!r}")
    if host_row is not None:
        if path == "slab":
            raise ValueError("host_row= needs the fused kernel: the slab path's launches draw a key per slab")
        update = ParamUpdate(spec, weight, state, step=step, seed=seed, rounding=rounding, host_row=host_row,
                             **hypers)
        x2, dy2 = check_linear(x, dy, weight, rounding)
        weight_view(weight, "weight")
        update._fused(x2, dy2, weight, update.states, update.key, tf32, config)
        update.commit()
        return
    if path == "slab":
        slab_linear_step(spec, x, dy, weight, state, step=step, seed=seed, rounding=rounding, slab_bytes=slab_bytes,
                         **hypers)
        return
    _linear(spec, x, dy, weight, state, step, seed, rounding, tf32, config, slab_bytes, hypers, path)


def _linear(spec, x, dy, weight, state, step, seed, rounding: str, tf32: bool, config: Optional[TileConfig],
            slab_bytes: Optional[int], hypers: dict, path: str) -> None:
    """The one way into a fused layer update (`path` "fused", or "auto" which may take the slab path): a
    prepared launch where one exists for this metadata, else every check and the launch, remembered."""
    spec = load_spec(spec)
    reusable = _reuse_key(spec, hypers, x, dy, weight, state, rounding, tf32, config)
    if reusable is not None and _launch_prepared(reusable, x, dy, weight, state, step, seed, auto=path == "auto"):
        reuse.COUNTS["reused"] += 1
        return
    if path == "auto" and _auto_path(x, dy, weight, state) == "slab":
        reuse.COUNTS["slab"] += 1
        slab_linear_step(spec, x, dy, weight, state, step=step, seed=seed, rounding=rounding, slab_bytes=slab_bytes,
                         **hypers)
        return
    if reusable is not None:
        reuse.COUNTS["checked"] += 1
    x2, dy2 = check_linear(x, dy, weight, rounding)
    weight_view(weight, "weight")
    update = ParamUpdate(spec, weight, state, step=step, seed=seed, rounding=rounding, **hypers)
    launched = update._fused(x2, dy2, weight, update.states, update.key, tf32, config)
    update.commit()
    if reusable is not None and launched is not None:
        _prepare(reusable, update, *launched)


def launch_host_values(spec: SpecLike, step: int, state: MutableMapping[str, torch.Tensor], **hypers: Any) -> tuple:
    """The host scalars a launch of step `step` hands its kernel (what `host_table.HostTable.stage` takes): the
    ones every by-value launch of these keywords and scalar state passes."""
    return _variant(load_spec(spec), hypers, step, state)[2]


def _auto_path(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor, state) -> str:
    """`auto_linear_path` of one `linear_step` call's arguments."""
    tokens = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    quantized = any(holds_codes(t) for t in state.values() if isinstance(t, torch.Tensor))
    tma = all(tma_readable(t) for t in (x, dy))
    return auto_linear_path(tokens, weight.numel(), x.dtype, weight.device, quantized, tma=tma)


def _reuse_key(spec, hypers: dict, x, dy, weight, state, rounding, tf32, config) -> Optional[tuple]:
    """(key, resolved keywords, spec) of a call that can reuse a prepared warp-specialized launch
    (forge_dsl/kernels/reuse.py), or None: reuse off, not a Hopper GPU, a layer below the warp-specialized
    kernel's size under the default config, or keywords the checked path must refuse (it raises, in its own
    order)."""
    why = None
    if not reuse.enabled():
        why = "reuse off"
    elif not isinstance(weight, torch.Tensor) or not hopper_with_gluon(weight.device):
        why = "not a Hopper GPU with Gluon"
    elif config is None and weight.numel() < WS_MIN_ELEMENTS:
        why = "below the warp-specialized size"
    if why is not None:
        reuse.COUNTS[why] += 1
        return None
    try:
        resolved = resolved_hypers(spec, hypers)
    except (ValueError, TypeError):
        reuse.COUNTS["keywords refused"] += 1
        return None
    names = compiled_variants(spec)[resolved.variant].states
    key = reuse.call_key(spec, resolved.variant, names, _scalar_names(spec), x, dy, weight, state, rounding, tf32,
                            config)
    if key is None:
        reuse.COUNTS["no key"] += 1
        return None
    return key, resolved, spec


def _scalar_names(spec) -> tuple[str, ...]:
    return tuple(s.name for s in spec.scalars)


def _launch_prepared(reusable: tuple, x, dy, weight, state, step, seed, auto: bool) -> bool:
    """Launch the call prepared under `reusable`'s key; False where there is none, or where `linear_step(path=
    "auto")` (`auto`) would not take the fused kernel for this metadata, or the entry cannot launch this step."""
    key, resolved, spec = reusable
    hit = reuse.lookup(key, spec)
    if hit is None:
        return False
    if auto:
        if hit.auto_path is None:
            hit.auto_path = _auto_path(x, dy, weight, state)
        if hit.auto_path != "fused":
            return False
    check_step(step)
    with device_guard(weight):
        scalar_updates = hit.launch(x, dy, weight, state, resolved.host_inputs, int(step), mix_seed(seed, step))
    if scalar_updates is None:
        return False
    for name, value in scalar_updates.items():
        state[name].fill_(value)
    return True


def _prepare(reusable: tuple, update: ParamUpdate, cfg: TileConfig, launched: tuple) -> None:
    """Remember a checked warp-specialized launch under `reusable`'s key for later calls with the same metadata."""
    from .gluon_lib import fused_ws

    key, resolved, spec = reusable
    compiled, args, kwargs, programs = launched
    host = _kernel_host(compiled_variants(spec)[resolved.variant].host)
    try:
        entry = reuse.PreparedLaunch(spec, host, update.names, update.state, _scalar_names(spec),
                                        fused_ws, compiled, args, kwargs, programs,
                                        ([cfg.block_t, cfg.block_k], [cfg.block_t, cfg.block_n]))
    except reuse.NotReusable:  # every call of this layer stays checked
        return
    reuse.remember(key, entry)


def slab_linear_step(
    spec: SpecLike,
    x: torch.Tensor,
    dy: torch.Tensor,
    weight: torch.Tensor,
    state: MutableMapping[str, torch.Tensor],
    *,
    step: int,
    seed: int = DEFAULT_SEED,
    rounding: str = DEFAULT_ROUNDING,
    slab_bytes: Optional[int] = None,
    **hypers: Any,
) -> None:
    """The update of `fused_linear_step`, with dW computed by cuBLAS one slab of rows at a time.

    dW[r0:r1] = dy[:, r0:r1]ᵀ · x, in the activations' dtype like autograd's, is consumed at once by
    the element-wise step kernel: at most `slab_bytes` of gradient exist at any time (whole rows, a
    multiple of 128 where there are that many, at least one), little enough to stay in L2 between
    the GEMM that writes it and the kernel that reads it. The full dW is never stored. Float32
    products follow torch's matmul precision. (A bf16 GEMM with an fp32 output, which would keep
    the fused kernel's precision, ran 2–8× slower in torch 2.11: docs/PERF.md, v3.)

    Arguments as for `fused_linear_step`, plus `slab_bytes`: by default `SLAB_BYTES` (16 MiB), and
    `SLAB_BYTES_QUANTIZED` (32 MiB) with int8 / uint8 state: half the host's launches for the same
    GPU time, on a path whose short int8 step kernels leave the host little slack (docs/PERF.md, v6). The
    stochastic-rounding bits are a function of (seed, step, the slab's first row, element index in
    the slab): not the bits `fused_linear_step` draws.
    """
    spec = load_spec(spec)
    x2, dy2 = check_linear(x, dy, weight, rounding)
    if slab_bytes is not None and (isinstance(slab_bytes, bool) or int(slab_bytes) != slab_bytes or slab_bytes < 1):
        raise ValueError(f"slab_bytes must be a positive integer or None, got {slab_bytes!r}")
    # bound once for the whole tensors; each slab takes row slices of the same kernel arguments
    update = ParamUpdate(spec, weight, state, step=step, seed=seed, rounding=rounding, **hypers)
    if slab_bytes is None:
        slab_bytes = default_slab_bytes(any_quantized(update.states.layouts))
    for r0, grad in slab_grads(x2, dy2, slab_bytes):
        update.from_grad(grad, rows=r0)
    update.commit()


def step(
    spec: SpecLike,
    param: torch.Tensor,
    grad: torch.Tensor,
    state: MutableMapping[str, torch.Tensor],
    *,
    step: int,
    seed: int = DEFAULT_SEED,
    rounding: str = DEFAULT_ROUNDING,
    **hypers: Any,
) -> None:
    """Update `param` and `state` in place from a materialized gradient (element-wise kernel).

    Args:
        spec: built-in name, path to a `.fopt`, or loaded spec.
        param: any shape, contiguous, float32 or bfloat16.
        grad: same shape, float32 or bfloat16, contiguous.
        state: from `forge_dsl.init_state(spec, param, layout=...)`.
        step, seed, rounding, **hypers: as for `fused_linear_step`.
    """
    spec = load_spec(spec)
    check_rounding(rounding)
    if grad.shape != param.shape:
        raise ValueError(f"grad has shape {tuple(grad.shape)} but param has {tuple(param.shape)}; they must match")
    if not param.is_contiguous():
        raise ValueError("param must be contiguous (it is updated in place)")
    for t, what in ((param, "param"), (grad, "grad")):
        check_device(t, what)
        if t.device != param.device:
            raise ValueError(f"{what} is on {t.device} but param is on {param.device}")
    weight_view(param, "param")  # dtype checks before any other work
    weight_view(grad, "grad")
    update = ParamUpdate(spec, param, state, step=step, seed=seed, rounding=rounding, **hypers)
    update.from_grad(grad)
    update.commit()
