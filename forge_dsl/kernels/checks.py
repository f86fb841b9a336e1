"""Checks of the kernels' arguments, and the binding of a parameter's state to the kernels' state arguments.

Every refusal of a launch happens here, before any kernel runs: shapes, dtypes, devices, strides, the
state's layouts against the spec, a tile config against what the kernels can run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, MutableMapping

import torch

from .layouts import (BLOCK, SCALE_DTYPES, StateLayout, as_rows, is_quantized, layout_of, n_blocks, quantized_layout,
                      storage_shape)
from .policy import TileConfig, hopper_with_gluon, interpreting

ROUNDINGS = ("stochastic", "nearest")  # how a bf16 weight is written (`kernel_calls.rounding_code`)
DEFAULT_ROUNDING = "stochastic"
DEFAULT_SEED = 0  # the stochastic-rounding seed of every entry point that takes one


def check_rounding(rounding: str) -> None:
    """Refuse a rounding that is not one of `ROUNDINGS` (a ValueError naming them)."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")


def check_config(cfg: TileConfig, quantized: bool) -> None:
    """Refuse a tile config the fused kernel cannot run: blocks that are powers of two ≥ 16, BLOCK_K a
    multiple of 64, and with quantized state, epilogue slices that hold whole 64-element scale blocks (the
    Triton kernel's column slices; the warp-specialized kernel's row slices always do)."""
    for name in ("block_t", "block_n", "block_k"):
        v = getattr(cfg, name)
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two ≥ 16, got {v} in {cfg}")
    if cfg.block_k % BLOCK:
        raise ValueError(f"block_k must be a multiple of {BLOCK}, got {cfg}")
    slice_k = cfg.block_k // cfg.epilogue_split  # the Triton kernel's column slices (the warp-specialized: rows)
    if quantized and not cfg.warp_specialized and slice_k % BLOCK:
        raise ValueError(f"the epilogue's slices (block_k / epilogue_split = {slice_k} columns) must be a multiple of "
                         f"{BLOCK} for int8 state; use a smaller epilogue_split or a larger block_k, got {cfg}")


def check_device(t: torch.Tensor, what: str) -> None:
    if t.is_meta:
        raise ValueError(f"{what} is a meta tensor, which has no data to update; materialize it first "
                         "(e.g. model.to_empty(device='cuda') and initialize the weights)")
    if t.device.type == "cpu" and not interpreting():
        raise ValueError(
            f"{what} is on the CPU; the kernels run on CUDA tensors, or on CPU tensors in the Triton "
            "interpreter (set TRITON_INTERPRET=1 before importing triton)"
        )


_EXACT: dict[int, tuple[Any, frozenset]] = {}  # id(spec) -> (spec, names): hashing a spec walks its whole IR


def exact_states(spec) -> frozenset[str]:
    """The states of `spec` that only an fp32 tensor may hold (`ir.State.must_stay_exact`)."""
    hit = _EXACT.get(id(spec))
    if hit is None or hit[0] is not spec:
        hit = _EXACT[id(spec)] = (spec, frozenset(s.name for s in spec.states if s.must_stay_exact))
    return hit[1]


@dataclass(frozen=True)
class StateArgs:
    """The kernels' state arguments (`tile_kernels`) for a variant's states `names`, in that order: each
    state's storage (bf16 as its int16 view), its block scales (int8 / uint8: float32, or bfloat16 as its int16
    view; the storage itself, never read, otherwise) and its layout code."""

    storage: tuple[torch.Tensor, ...]
    scales: tuple[torch.Tensor, ...]
    layouts: tuple[int, ...]

    def rows(self, r0: int, r1: int) -> "StateArgs":
        """The arguments of rows [r0, r1) of a 2-D parameter (storage [N, K] and scales [N, K / 64] alike)."""
        return StateArgs(tuple(t[r0:r1] for t in self.storage), tuple(t[r0:r1] for t in self.scales), self.layouts)


def bind_states(spec, names: tuple[str, ...], state: MutableMapping[str, torch.Tensor],
                   weight: torch.Tensor) -> StateArgs:
    """The kernels' arguments for the variant's states `names`, each checked against `weight` (`check_state`)."""
    storages: list[torch.Tensor] = []
    scales: list[torch.Tensor] = []
    layouts: list[int] = []
    for name in names:
        if name not in state:
            raise ValueError(
                f"state has no '{name}', which {spec.name} needs with these flags; "
                "create the state with forge_dsl.init_state(spec, param, layout=..., **hypers) using the same flags"
            )
        layout = check_state(spec, name, state, weight)
        t = state[name]
        if is_quantized(layout):
            storage, scale = t, state[f"{name}.scale"]
            if scale.dtype == torch.bfloat16:
                scale = scale.view(torch.int16)  # the kernels read bf16 scales as bits (`state_lib.load_state_raw`)
        else:
            storage = t.view(torch.int16) if layout == StateLayout.BF16 else t
            scale = storage  # never read: the layout is a constexpr
        storages.append(storage)
        scales.append(scale)
        layouts.append(int(layout))
    return StateArgs(tuple(storages), tuple(scales), tuple(layouts))


def check_state(spec, name: str, state, weight: torch.Tensor, what: str = "") -> StateLayout:
    """The layout of `state[name]`, the storage of `spec`'s state `name` for the parameter `weight`, after checking
    that it is what that state needs (`check_state_kind`), shaped for the parameter, on its device, contiguous, and
    for int8 / int4 codes beside a `<name>.scale` of the block scales' dtype and shape: a ValueError naming it (as
    `what`, default "state 'NAME'") otherwise, before any kernel runs."""
    what = what or f"state '{name}'"
    t = state[name]
    layout = check_state_kind(spec, name, state, weight.shape, what)
    if tuple(t.shape) != storage_shape(layout, weight.shape):
        raise ValueError(f"{what} has shape {tuple(t.shape)} but the parameter has {tuple(weight.shape)}"
                         + (" (int4 state holds two codes a byte: the parameter's shape with its last dim halved)"
                            if t.dtype in (torch.int8, torch.uint8) else ""))
    if t.device != weight.device:
        raise ValueError(f"{what} is on {t.device} but the parameter is on {weight.device}")
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous")
    if is_quantized(layout):
        scale = state.get(f"{name}.scale")
        rows, cols = as_rows(weight).shape
        if (scale is None or scale.dtype not in SCALE_DTYPES or tuple(scale.shape) != (rows, n_blocks(cols))
                or scale.device != weight.device or not scale.is_contiguous()):
            raise ValueError(
                f"{'int4' if layout in (StateLayout.INT4, StateLayout.UINT4) else 'int8'} {what} needs "
                f"'{name}.scale', a contiguous float32 or bfloat16 tensor of shape ({rows}, {n_blocks(cols)}) "
                f"on the parameter's device"
            )
    return layout


def check_state_kind(spec, name: str, state, param_shape, what: str = "") -> StateLayout:
    """The layout `state[name]` holds for a parameter of `param_shape` (`layouts.layout_of`: its dtype, and its
    shape for 4-bit codes), after checking it is one `spec`'s state `name` can have: a storage dtype; fp32 for a
    state that must stay exact (`exact_states`); int8 / int4 codes of the map its `nonneg` declaration gives
    (`layouts.quantized_layout`, the rule `init_state` makes states by: uint8 codes for nonneg states, int8 for
    signed ones); float storage without a `<name>.scale` beside it (codes cast to float keep their scales, and
    would be updated as values). A ValueError naming it (`what`) otherwise."""
    what = what or f"state '{name}'"
    t = state[name]
    layout = layout_of(t, param_shape)
    if layout is None:
        raise ValueError(f"{what} has dtype {t.dtype}; expected float32, bfloat16, int8 or uint8")
    scale_name = f"{name}.scale"
    if not is_quantized(layout) and scale_name in state:
        raise ValueError(
            f"{what} is {t.dtype}, but '{scale_name}' (block scales) sits beside it: int8 or int4 codes "
            f"converted to {t.dtype} (a cast, or dcp.load into a float optimizer's state) would be updated as "
            f"values. Pass the codes in their own dtype, or a state from forge_dsl.init_state(spec, param, "
            f"layout=...)")
    if layout != StateLayout.FP32 and name in exact_states(spec):
        raise ValueError(f"{what} of {spec.name} must stay exact (see forge_dsl.api.state_layout) but is "
                         f"stored as {t.dtype}; create it with forge_dsl.init_state, which keeps it float32")
    if is_quantized(layout):
        nonneg = any(s.nonneg for s in spec.states if s.name == name)
        want = quantized_layout(layout.layout_name, nonneg)
        if layout != want:
            declared = "declared nonneg" if nonneg else "not declared nonneg (signed)"
            raise ValueError(
                f"{what} holds {layout.storage_words}, but {spec.name}'s '{name}' is {declared}: as "
                f"{layout.layout_name} it is {want.storage_words}, and the kernels would decode these codes with the "
                f"wrong map. Create the state with forge_dsl.init_state(spec, param, layout=...)")
    return layout


def any_quantized(layouts: tuple[int, ...]) -> bool:
    """Whether any state (by its layout code, as in `StateArgs.layouts`) is int8 / uint8 quantized."""
    return any(is_quantized(code) for code in layouts)


def weight_view(t: torch.Tensor, what: str) -> tuple[torch.Tensor, bool]:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16), True
    if t.dtype == torch.float32:
        return t, False
    raise ValueError(f"{what} has dtype {t.dtype}; the kernels support float32 and bfloat16")


def check_linear(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor, rounding: str):
    """Validate one linear layer's (x, dy, weight); returns x [T, K] and dy [T, N] as 2-D views."""
    check_rounding(rounding)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    N, K = weight.shape
    if x.dim() == 0 or dy.dim() == 0:
        raise ValueError(f"x [..., K] and dy [..., N] need a feature dim, got shapes {tuple(x.shape)} and "
                         f"{tuple(dy.shape)}")
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} features in its last dim but weight [N, K] has K = {K}")
    if dy.shape[-1] != N:
        raise ValueError(f"dy has {dy.shape[-1]} features in its last dim but weight [N, K] has N = {N}")
    if x.shape[:-1] != dy.shape[:-1]:
        raise ValueError(f"x {tuple(x.shape)} and dy {tuple(dy.shape)} must have the same leading (token) dims")
    if x.dtype != dy.dtype or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"x and dy must both be float32 or both bfloat16, got {x.dtype} and {dy.dtype}")
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous (it is updated in place); pass a contiguous parameter")
    for t, what in ((x, "x"), (dy, "dy"), (weight, "weight")):
        check_device(t, what)
        if t.device != weight.device:
            raise ValueError(f"{what} is on {t.device} but weight is on {weight.device}")
    T = math.prod(x.shape[:-1])  # not reshape(-1, K): that cannot infer T where K (or N) is 0
    return x.reshape(T, K), dy.reshape(T, N)


def check_warp_specialized(fused_ws, x2: torch.Tensor, weight: torch.Tensor, tma_ok: bool, cfg: TileConfig) -> None:
    """Refuse a warp-specialized config where `gluon_lib.fused_ws` cannot run, saying what to use instead."""
    if fused_ws is None:
        raise ValueError(f"{cfg} asks for the warp-specialized kernel, which needs Triton ≥ 3.6 with Gluon; "
                         "use a config without mma_warps")
    if not hopper_with_gluon(weight.device):
        raise ValueError(f"{cfg} asks for the warp-specialized kernel, which runs only compiled on a Hopper GPU "
                         "(sm_90; Gluon has no interpreter); use a config without mma_warps")
    if x2.dtype != torch.bfloat16:
        raise ValueError(f"the warp-specialized kernel multiplies bfloat16 activations, got {x2.dtype}; "
                         "use a config without mma_warps")
    if not tma_ok:
        raise ValueError("the warp-specialized kernel reads x and dy through TMA: both need at least one token, rows "
                         "of contiguous elements, 16-byte aligned starts and row strides; use a config without "
                         "mma_warps")


def tma_readable(t: torch.Tensor) -> bool:
    """`tma_compatible` of the 2-D [tokens, C] that the fused kernel makes of an activation [..., C]
    (`t.reshape(-1, C)`), without making it: a view where the strides allow one, else the contiguous
    copy that `reshape` would return (16-byte aligned, rows of C elements)."""
    if t.numel() == 0:
        return False
    try:
        return tma_compatible(t.view(-1, t.shape[-1]))
    except RuntimeError:  # not viewable: the kernel gets a contiguous copy
        row_bytes = t.shape[-1] * t.element_size()
        return row_bytes % 16 == 0 and row_bytes >= 16


def tma_compatible(t: torch.Tensor) -> bool:
    """A 2-D activation [T, C] a TMA descriptor can read: T > 0, rows contiguous and not overlapping,
    a 16-byte aligned start and row stride, and rows of at least 16 bytes."""
    size = t.element_size()
    return (t.dim() == 2 and t.shape[0] > 0 and t.stride(1) == 1 and t.stride(0) >= t.shape[1]
            and (t.stride(0) * size) % 16 == 0 and t.data_ptr() % 16 == 0 and t.shape[1] * size >= 16)

