"""Host side of the generated kernels: validate, pick the variant, compute host scalars, launch.

    fused_linear_step(spec, x, dy, weight, state, step=t, **hypers)
        x [..., K] and dy [..., N] of one linear layer y = x Wᵀ; weight [N, K] and
        its state updated in place from dW = dyᵀ x, which is never stored.
    slab_linear_step(spec, x, dy, weight, state, step=t, **hypers)
        the same, with dW from cuBLAS one L2-sized slab of rows at a time (never whole).
    step(spec, param, grad, state, step=t, **hypers)
        the same update from a materialized gradient, for any parameter shape.

`state` is what `forge_dsl.init_state(spec, param, layout=...)` returns.
On a machine without CUDA, tensors live on the CPU and the kernels run in the
Triton interpreter (`TRITON_INTERPRET=1` must be set before triton is imported).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from dataclasses import dataclass
from typing import Any, MutableMapping, Optional

import torch

from ..api import SpecLike, load_spec
from ..config import check_seed, check_step, resolve_hypers
from ..layouts import BLOCK, StateLayout, as_rows, holds_codes, is_quantized, layout_of_dtype, n_blocks, storage_dtype
from . import prepared
from .compiled import compiled_module

__all__ = ["fused_linear_step", "slab_linear_step", "linear_step", "step", "TileConfig", "mix_seed"]

_ROUNDINGS = ("stochastic", "nearest")
DEFAULT_SEED = 0  # fused_linear_step's defaults, which linear_step's reused launches apply too
DEFAULT_ROUNDING = "stochastic"


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes and launch options of the fused kernel (one program per tile)."""

    block_t: int
    block_n: int
    block_k: int
    group_n: int = 8
    num_warps: int = 8
    num_stages: int = 3
    k_halves: bool = False  # accumulate the tile as two column halves (two dots per token block)
    tma: bool = False  # read the activations with Hopper TMA copies where their layout allows it
    # the epilogue runs on 1, 2 or 4 slices of the tile, one at a time (default: 2 with k_halves, else 1): column
    # slices in the Triton kernel, row slices in the warp-specialized one
    epilogue_split: Optional[int] = None
    maxnreg: Optional[int] = None  # cap on registers per thread (more programs per SM; the rest spills)
    # Warp-specialized kernel (`gluon_lib.fused_ws`, Hopper GPUs) when mma_warps is 4
    # or 8: one persistent program per SM, a TMA loader warp, mma_warps warps of wgmma (mma_registers each),
    # num_warps epilogue warps, num_stages ring buffers; the epilogue reads a tile in epilogue_split row slices.
    mma_warps: int = 0
    mma_registers: Optional[int] = None
    # the warp-specialized epilogue loads each slice's weights and state before it updates the slice before
    prefetch: bool = True
    # the warp-specialized kernel's MMA warps update the last mma_slices row slices of each tile themselves,
    # between its token loop and the next tile's (the epilogue warps the others)
    mma_slices: int = 0

    def __post_init__(self):
        if self.epilogue_split is None:
            object.__setattr__(self, "epilogue_split", 2 if self.k_halves else 1)
        if self.epilogue_split not in (1, 2, 4):
            raise ValueError(f"epilogue_split must be 1, 2 or 4, got {self.epilogue_split}")
        if self.k_halves and self.epilogue_split == 1:
            raise ValueError("k_halves accumulates two column halves: give it epilogue_split=2 or 4")
        if self.maxnreg is not None and not 24 <= self.maxnreg <= 255:
            raise ValueError(f"maxnreg must be in [24, 255] registers per thread, got {self.maxnreg}")
        if self.mma_warps not in (0, 4, 8):
            raise ValueError(f"mma_warps must be 0 (the Triton kernel), 4 or 8 (warp-specialized), "
                             f"got {self.mma_warps}")
        if self.mma_warps:
            if (self.block_n, self.block_k) != (128, 128) or self.k_halves or self.block_t % 16:
                raise ValueError("the warp-specialized kernel (mma_warps > 0) takes 128×128 tiles, whole (no "
                                 f"k_halves), and block_t a multiple of 16, got {self}")
            if self.num_stages < 2 or not self.tma:
                # one ring buffer would deadlock: the loader waits for it while the MMA waits for the next block
                raise ValueError("the warp-specialized kernel (mma_warps > 0) reads through a TMA ring of at least "
                                 f"2 buffers: give it tma=True and num_stages >= 2, got {self}")
            if self.mma_registers is None:
                object.__setattr__(self, "mma_registers", 104 if self.mma_warps == 8 else 200)
            if not (24 <= self.mma_registers <= 256 and self.mma_registers % 8 == 0):
                raise ValueError(f"mma_registers must be a multiple of 8 in [24, 256], got {self.mma_registers}")
            if not 0 <= self.mma_slices < self.epilogue_split:
                raise ValueError(f"mma_slices must leave the epilogue warps at least one of the tile's "
                                 f"{self.epilogue_split} row slices (0 <= mma_slices < epilogue_split), got {self}")
        elif self.mma_registers is not None or self.mma_slices:
            raise ValueError(f"mma_registers and mma_slices apply to the warp-specialized kernel only: give "
                             f"mma_warps 4 or 8, got {self}")

    @property
    def warp_specialized(self) -> bool:
        return self.mma_warps > 0

    @property
    def launch_maxnreg(self) -> Optional[int]:
        """`maxnreg` of the launch: with warp specialization, the 64 K registers of an SM shared by every warp of
        its one program (the loader's warp group counts 4), which the partitions then redistribute."""
        if not self.warp_specialized or self.maxnreg is not None:
            return self.maxnreg
        return min(255, 65536 // ((self.num_warps + 4 + self.mma_warps) * 32)) // 8 * 8

    @property
    def tma_blocks(self) -> tuple[list[int], list[int]]:
        """The TMA block shapes of X and DY: [BLOCK_T, BLOCK_K] (BLOCK_K / 2 with k_halves) and [BLOCK_T, BLOCK_N]."""
        return [self.block_t, self.block_k // 2 if self.k_halves else self.block_k], [self.block_t, self.block_n]

    @classmethod
    def parse(cls, text: str) -> "TileConfig":
        """'BT,BN,BK,WARPS,STAGES[,HALVES[,TMA]][,split=S][,maxnreg=R][,ws=M][,mmaregs=R][,prefetch=P]
        [,mmaslices=U]' → a TileConfig; HALVES and TMA are 0 or 1, S 1, 2 or 4 (2 when HALVES is 1 and no split is
        given), R registers per thread, M the warp-specialized kernel's MMA warps (4 or 8; it reads through TMA),
        P 0 or 1, U the row slices of each tile its MMA warps update.
        '64,128,128,8,3,0,1,split=4,maxnreg=128' → TileConfig(64, 128, 128, num_warps=8, num_stages=3, tma=True,
        epilogue_split=4, maxnreg=128); '64,128,128,8,5,split=4,ws=8' → the warp-specialized default."""
        keywords = {}
        try:
            tokens = text.split(",")
            values = [int(v) for v in tokens if "=" not in v]
            for token in (t for t in tokens if "=" in t):
                key, value = token.split("=")
                if key.strip() not in _CONFIG_KEYWORDS or key.strip() in keywords:
                    raise ValueError
                keywords[key.strip()] = int(value)
            if len(values) not in (5, 6, 7) or any(v not in (0, 1) for v in values[5:]) or \
                    keywords.get("prefetch", 0) not in (0, 1):
                raise ValueError
        except ValueError:
            raise ValueError("a tile config is five integers BT,BN,BK,WARPS,STAGES, then optionally HALVES and TMA "
                             "(0 or 1), split=1|2|4, maxnreg=REGISTERS, ws=MMA_WARPS, mmaregs=REGISTERS and "
                             "prefetch=0|1 and mmaslices=SLICES, "
                             f"got {text!r}") from None
        bt, bn, bk, warps, stages, *rest = values
        halves = bool(rest[0]) if rest else False
        ws = keywords.get("ws", 0)
        return cls(block_t=bt, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, k_halves=halves,
                   tma=bool(rest[1]) if len(rest) > 1 else bool(ws), epilogue_split=keywords.get("split"),
                   maxnreg=keywords.get("maxnreg"), mma_warps=ws, mma_registers=keywords.get("mmaregs"),
                   prefetch=bool(keywords.get("prefetch", 1)), mma_slices=keywords.get("mmaslices", 0))


_CONFIG_KEYWORDS = ("split", "maxnreg", "ws", "mmaregs", "prefetch", "mmaslices")  # TileConfig.parse's key=value


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=1024)  # called on every step with the same arguments; TileConfig is frozen
def fused_config(T: int, N: int, K: int, device: torch.device, quantized: bool = False,
                 activations: torch.dtype = torch.bfloat16, warp_specialize: bool = True,
                 hopper: Optional[bool] = None, stored_bytes: int = 6) -> TileConfig:
    """Tiles for the fused kernel: large in the interpreter (few programs), measured on the H200 on CUDA.

    The rules, in the order the code applies them (why each holds: docs/PERF.md, the entry named):
    * float32 activations: 64×64 tiles with plain loads (v2; their blocks take twice the shared memory).
    * Hopper with Gluon, bf16 activations a TMA descriptor can read (`warp_specialize`), layers of at least
      `WS_MIN_ELEMENTS`: the warp-specialized kernel (v7, v9): 128×128 tiles, a `WS_STAGES`-buffer TMA ring
      (v12e, v13a), 8 MMA and 8 epilogue warps on 32-row slices; its epilogue prefetches the next slice
      where weights and state take at most `WS_PREFETCH_MAX_BYTES` per element (`stored_bytes`) and the
      state is not quantized (v7, v9); up to `WS_MMA_SLICE_MAX_TOKENS` tokens, with the prefetch or int8
      state, the MMA warps update one of each tile's four slices themselves (v8, v9).
    * int8 / uint8 state (`quantized`): up to 4096 tokens 128×64 tiles, 8 warps capped at 128 registers,
      TMA (v5); above, 128×128 tiles (v3).
    * up to 512 tokens on layers of 2^24 elements and more, and up to 1024 tokens under 2^22 elements:
      64×64 tiles (v2, v5).
    * otherwise 128×128 tiles with a quarter-slice epilogue capped at 128 registers, TMA (v2 to v4).
    `hopper`: whether `device` is such a GPU (default: ask it; pass True to plan for one from anywhere).
    """
    if device.type != "cuda":
        return TileConfig(block_t=64, block_n=64, block_k=64, group_n=8, num_warps=4, num_stages=1)
    if activations == torch.float32:
        return TileConfig(block_t=64, block_n=64, block_k=64, group_n=8, num_warps=4, num_stages=4)
    large = N * K >= 2**24
    if hopper is None:
        hopper = _hopper_with_gluon(device)
    if warp_specialize and hopper and N * K >= WS_MIN_ELEMENTS:
        prefetch = stored_bytes <= WS_PREFETCH_MAX_BYTES and not quantized
        return TileConfig(block_t=64, block_n=128, block_k=128, group_n=8, num_warps=8, num_stages=WS_STAGES,
                          tma=True, epilogue_split=4, mma_warps=8, prefetch=prefetch,
                          mma_slices=1 if (prefetch or quantized) and T <= WS_MMA_SLICE_MAX_TOKENS else 0)
    if quantized:
        if T <= 4096:
            return TileConfig(block_t=64, block_n=128, block_k=64, group_n=8, num_warps=8, num_stages=4, tma=True,
                              maxnreg=128)
        return TileConfig(block_t=64, block_n=128, block_k=128, group_n=8, num_warps=8, num_stages=4, tma=large)
    if (T <= 512 and large) or (T <= 1024 and N * K < 2**22):
        return TileConfig(block_t=64, block_n=64, block_k=64, group_n=8, num_warps=4, num_stages=4, tma=large)
    return TileConfig(block_t=64, block_n=128, block_k=128, group_n=8, num_warps=8, num_stages=3, tma=True,
                      epilogue_split=4, maxnreg=128)


# the warp-specialized kernel's TMA ring: 5 buffers of 32 KiB beside the 64 KiB dW tile, 224 of the SM's 227 KiB of
# shared memory (docs/PERF.md, v12e / v13a: the MMA warps wait for activation copies; one buffer more than v7's 4
# took 1-4 % off at 2048 tokens on every Llama-3.1-8B shape, level at 512 and 8192)
WS_STAGES = 5
WS_MIN_ELEMENTS = 2**22  # the warp-specialized kernel from here: 256 tiles of 128×128 for 132 SMs (see fused_config)
WS_PREFETCH_MAX_BYTES = 6  # the warp-specialized epilogue's prefetch fits its registers up to this (see fused_config)
WS_MMA_SLICE_MAX_TOKENS = 512  # up to this T, the warp-specialized kernel's MMA warps update a slice of each tile


def stored_bytes(w_bf16: bool, layouts: tuple[int, ...]) -> int:
    """Bytes per element of a weight (bf16 or fp32) and its states (their layout codes)."""
    return (2 if w_bf16 else 4) + sum(storage_dtype(code).itemsize for code in layouts)


def _hopper_with_gluon(device: torch.device) -> bool:
    """Whether `gluon_lib.fused_ws` runs on `device`: a Hopper GPU (sm_90), a Triton with Gluon, no interpreter."""
    if device.type != "cuda" or interpreting():
        return False
    return _hopper_gpu_with_gluon(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _hopper_gpu_with_gluon(index: int) -> bool:
    """`_hopper_with_gluon` of CUDA device `index`, asked once (a few tens of µs a call otherwise, on every step)."""
    from . import gluon_lib

    return gluon_lib.AVAILABLE and torch.cuda.is_available() and torch.cuda.get_device_capability(index)[0] == 9


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


def step_config(rows: int, cols: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for the element-wise step kernel; BLOCK_K is a multiple of 64.

    On CUDA, 2048-element tiles (8 × 256 for wide rows) and 4 warps: 16 elements per thread, as
    v2's 4096-element tiles with 8 warps had, in programs half the size. Measured on the H200
    (docs/PERF.md, v6): 13–15 % faster with int8 state (AdamW 0.073 against 0.084 ms at 4096²,
    0.240 against 0.284 at 14336×4096; NAdam and Lion 11 % and 6 %), level with bf16 state (0.062).
    """
    block_k = 64 if cols <= 64 else (128 if cols <= 128 else 256)
    if device.type != "cuda":
        return 64, block_k, 4
    return max(1, 2048 // block_k), block_k, 4


def mix_seed(seed: int, step: int) -> int:
    """The key of `triton_lib.random_bits`, in [0, 2**31), from (seed, step): splitmix64 of both,
    so every step draws new bits. `seed` is any integer (its low 32 bits count; TypeError / ValueError
    naming it otherwise, `forge_dsl.config.check_seed`); `step` a checked step number."""
    z = ((check_seed(seed) & 0xFFFFFFFF) << 32 | (int(step) & 0xFFFFFFFF)) + 0x9E3779B97F4A7C15
    z &= 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    z ^= z >> 31
    return z & 0x7FFFFFFF


def _check_device(t: torch.Tensor, what: str) -> None:
    if t.is_meta:
        raise ValueError(f"{what} is a meta tensor, which has no data to update; materialize it first "
                         "(e.g. model.to_empty(device='cuda') and initialize the weights)")
    if t.device.type == "cpu" and not interpreting():
        raise ValueError(
            f"{what} is on the CPU; the kernels run on CUDA tensors, or on CPU tensors in the Triton "
            "interpreter (set TRITON_INTERPRET=1 before importing triton)"
        )


_EXACT: dict[int, tuple[Any, frozenset]] = {}  # id(spec) -> (spec, names): hashing a spec walks its whole IR


def _exact_states(spec) -> frozenset[str]:
    """The states of `spec` that only an fp32 tensor may hold (`ir.State.must_stay_exact`)."""
    hit = _EXACT.get(id(spec))
    if hit is None or hit[0] is not spec:
        hit = _EXACT[id(spec)] = (spec, frozenset(s.name for s in spec.states if s.must_stay_exact))
    return hit[1]


@dataclass(frozen=True)
class StateArgs:
    """The kernels' state arguments (`tile_kernels`) for a variant's states `names`, in that order: each
    state's storage (bf16 as its int16 view), its block scales (int8 / uint8; the storage itself, never
    read, otherwise) and its layout code."""

    storage: tuple[torch.Tensor, ...]
    scales: tuple[torch.Tensor, ...]
    layouts: tuple[int, ...]

    def rows(self, r0: int, r1: int) -> "StateArgs":
        """The arguments of rows [r0, r1) of a 2-D parameter (storage [N, K] and scales [N, K / 64] alike)."""
        return StateArgs(tuple(t[r0:r1] for t in self.storage), tuple(t[r0:r1] for t in self.scales), self.layouts)


def _prepare_state(spec, names: tuple[str, ...], state: MutableMapping[str, torch.Tensor],
                   weight: torch.Tensor) -> StateArgs:
    """The kernels' arguments for the variant's states `names`, checked against `weight`."""
    storages: list[torch.Tensor] = []
    scales: list[torch.Tensor] = []
    layouts: list[int] = []
    for name in names:
        if name not in state:
            raise ValueError(
                f"state has no '{name}', which {spec.name} needs with these flags; "
                "create the state with forge_dsl.init_state(spec, param, layout=..., **hypers) using the same flags"
            )
        t = state[name]
        if t.shape != weight.shape:
            raise ValueError(f"state '{name}' has shape {tuple(t.shape)} but the parameter has {tuple(weight.shape)}")
        if t.device != weight.device:
            raise ValueError(f"state '{name}' is on {t.device} but the parameter is on {weight.device}")
        if not t.is_contiguous():
            raise ValueError(f"state '{name}' must be contiguous")
        layout = layout_of_dtype(t.dtype)
        if layout is None:
            raise ValueError(f"state '{name}' has dtype {t.dtype}; expected float32, bfloat16, int8 or uint8")
        if layout != StateLayout.FP32 and name in _exact_states(spec):
            raise ValueError(f"state '{name}' of {spec.name} must stay exact (see forge_dsl.api.state_layout) but is "
                             f"stored as {t.dtype}; create it with forge_dsl.init_state, which keeps it float32")
        scale = state.get(f"{name}.scale")
        if is_quantized(layout):
            rows, cols = as_rows(weight).shape
            if scale is None or scale.dtype != torch.float32 or tuple(scale.shape) != (rows, n_blocks(cols)):
                raise ValueError(
                    f"int8 state '{name}' needs '{name}.scale', a float32 tensor of shape ({rows}, {n_blocks(cols)})"
                )
            storage = t
        else:
            storage = t.view(torch.int16) if layout == StateLayout.BF16 else t
            scale = storage  # never read: the layout is a constexpr
        storages.append(storage)
        scales.append(scale)
        layouts.append(int(layout))
    return StateArgs(tuple(storages), tuple(scales), tuple(layouts))


def any_quantized(layouts: tuple[int, ...]) -> bool:
    """Whether any state (by its layout code, as in `StateArgs.layouts`) is int8 / uint8 quantized."""
    return any(is_quantized(code) for code in layouts)


def _weight_view(t: torch.Tensor, what: str) -> tuple[torch.Tensor, bool]:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16), True
    if t.dtype == torch.float32:
        return t, False
    raise ValueError(f"{what} has dtype {t.dtype}; the kernels support float32 and bfloat16")


def _variant(spec, hypers: dict, step: int, state):
    """(the variant's update function, the states it reads, its host scalars, the new scalar state) of one step."""
    cfg = _resolved_hypers(spec, hypers)
    module = compiled_module(spec)
    host, update, names = module.VARIANTS[cfg.variant]
    _check_step(step)
    scalars = {s.name: float(state[s.name]) for s in spec.scalars if s.name in state}
    missing = [s.name for s in spec.scalars if s.name not in state]
    if missing:
        raise ValueError(f"state has no scalar state {missing}; create it with forge_dsl.init_state")
    exports, scalar_updates = host(cfg.host_inputs, int(step), scalars)
    return update, names, exports, scalar_updates


def _check_step(step) -> None:
    check_step(step)  # TypeError / ValueError naming `step` (forge_dsl.config)


_RESOLVED: dict = {}  # (id(spec), keywords) -> (spec, StepConfig): see _resolved_hypers
_RESOLVED_MAX = 256


def _resolved_hypers(spec, hypers: dict):
    """`resolve_hypers(spec, hypers)`, remembered for keywords of plain numbers, bools and tuples of numbers
    (a training loop passes the same ones every step, and resolving them took ~25 % of a call's host time,
    docs/PERF.md v9c); tensors (e.g. a tensor lr, which may change in place) are resolved every time. Only
    successes are remembered, so bad keywords raise on every call. The result is shared: read it only."""
    key = _hypers_key(hypers)
    if key is None:
        return resolve_hypers(spec, hypers)
    hit = _RESOLVED.get((id(spec), key))
    if hit is not None and hit[0] is spec:
        return hit[1]
    cfg = resolve_hypers(spec, hypers)
    if len(_RESOLVED) >= _RESOLVED_MAX:
        _RESOLVED.clear()
    _RESOLVED[(id(spec), key)] = (spec, cfg)
    return cfg


def _hypers_key(hypers: dict) -> Optional[tuple]:
    """A hashable key that tells apart every two keyword sets `resolve_hypers` could treat differently
    (types, and the sign of a zero), or None where a value is not a plain number, bool or tuple of them."""
    def one(v):
        if type(v) in (bool, int):
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


def _commit_scalars(state, scalar_updates: dict[str, float]) -> None:
    for name, value in scalar_updates.items():
        state[name].fill_(value)


def _check_linear(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor, rounding: str):
    """Validate one linear layer's (x, dy, weight); returns x [T, K] and dy [T, N] as 2-D views."""
    if rounding not in _ROUNDINGS:
        raise ValueError(f"rounding must be one of {_ROUNDINGS}, got {rounding!r}")
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
        _check_device(t, what)
        if t.device != weight.device:
            raise ValueError(f"{what} is on {t.device} but weight is on {weight.device}")
    T = math.prod(x.shape[:-1])  # not reshape(-1, K): that cannot infer T where K (or N) is 0
    return x.reshape(T, K), dy.reshape(T, N)


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
    config and Triton's argument binding are skipped, the keywords still resolved (forge_dsl/kernels/prepared.py;
    a third to a half of the host time).
    """
    spec = load_spec(spec)
    reuse = _reuse_key(spec, hypers, x, dy, weight, state, rounding, tf32, config)
    if reuse is not None and _launch_prepared(reuse, x, dy, weight, state, step, seed):
        return
    with _device_guard(weight):
        _fused_linear_step_checked(spec, x, dy, weight, state, step, seed, rounding, tf32, config, hypers, reuse)


def _fused_linear_step_checked(spec, x, dy, weight, state, step, seed, rounding: str, tf32: bool,
                               config: Optional[TileConfig], hypers: dict, reuse: Optional[tuple]) -> None:
    """`fused_linear_step` with every check; a warp-specialized launch is remembered under `reuse`'s key."""
    x2, dy2 = _check_linear(x, dy, weight, rounding)
    N, K = weight.shape
    T = x2.shape[0]
    w_view, w_bf16 = _weight_view(weight, "weight")
    update, names, exports, scalar_updates = _variant(spec, hypers, step, state)
    states = _prepare_state(spec, names, state, weight)
    if N == 0 or K == 0:
        _commit_scalars(state, scalar_updates)
        return
    quantized = any_quantized(states.layouts)
    tma_ok = tma_compatible(x2) and tma_compatible(dy2)
    cfg = config or fused_config(T, N, K, weight.device, quantized, x2.dtype, warp_specialize=tma_ok,
                                 stored_bytes=stored_bytes(w_bf16, states.layouts))
    check_config(cfg, quantized)
    if cfg.warp_specialized:
        from .gluon_lib import fused_ws

        if config is not None:  # fused_config picks it only where it runs
            _check_warp_specialized(fused_ws, x2, weight, tma_ok, cfg)
        compiled, args, kwargs, programs = _launch_warp_specialized(
            cfg, x2, dy2, w_view, w_bf16, states, update, exports, mix_seed(seed, step), rounding)
        _commit_scalars(state, scalar_updates)
        if reuse is not None:
            _prepare(reuse, spec, names, state, cfg, compiled, args, kwargs, programs)
        return
    from .tile_kernels import fused  # triton is imported on first launch

    dot_fp32 = interpreting() or x.dtype == torch.float32
    precision = ("tf32" if tf32 else "ieee") if dot_fp32 else None
    grid = (triton_cdiv(N, cfg.block_n) * triton_cdiv(K, cfg.block_k),)
    tma = cfg.tma and tma_compatible(x2) and tma_compatible(dy2)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor  # triton is imported on first launch

        x_block, dy_block = cfg.tma_blocks
        x_arg = TensorDescriptor.from_tensor(x2, x_block)
        dy_arg = TensorDescriptor.from_tensor(dy2, dy_block)
    else:
        x_arg, dy_arg = x2, dy2
    fused[grid](
        x_arg, dy_arg, w_view, states.storage, states.scales, exports,
        mix_seed(seed, step), T, N, K, n_blocks(K),
        x2.stride(0), x2.stride(1), dy2.stride(0), dy2.stride(1),
        UPDATE=update, W_BF16=w_bf16, STOCHASTIC=rounding_code(rounding, K), LAYOUTS=states.layouts,
        DOT_FP32=dot_fp32, INPUT_PRECISION=precision,
        BLOCK_T=cfg.block_t, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_N=cfg.group_n,
        K_HALVES=cfg.k_halves, EPILOGUE_SPLIT=cfg.epilogue_split, TMA=tma,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=cfg.maxnreg,
    )
    _commit_scalars(state, scalar_updates)


def _check_warp_specialized(fused_ws, x2: torch.Tensor, weight: torch.Tensor, tma_ok: bool, cfg: TileConfig) -> None:
    """Refuse a warp-specialized config where `gluon_lib.fused_ws` cannot run, saying what to use instead."""
    if fused_ws is None:
        raise ValueError(f"{cfg} asks for the warp-specialized kernel, which needs Triton ≥ 3.6 with Gluon; "
                         "use a config without mma_warps")
    if not _hopper_with_gluon(weight.device):
        raise ValueError(f"{cfg} asks for the warp-specialized kernel, which runs only compiled on a Hopper GPU "
                         "(sm_90; Gluon has no interpreter); use a config without mma_warps")
    if x2.dtype != torch.bfloat16:
        raise ValueError(f"the warp-specialized kernel multiplies bfloat16 activations, got {x2.dtype}; "
                         "use a config without mma_warps")
    if not tma_ok:
        raise ValueError("the warp-specialized kernel reads x and dy through TMA: both need at least one token, rows "
                         "of contiguous elements, 16-byte aligned starts and row strides; use a config without "
                         "mma_warps")


def _launch_warp_specialized(cfg: TileConfig, x2, dy2, w_view, w_bf16: bool, states: StateArgs, update,
                             exports: tuple, seed: int, rounding: str):
    """One launch of `gluon_lib.fused_ws`: one persistent program per SM (at most one per tile). Returns what
    `prepared.PreparedLaunch` repeats: (the compiled kernel, the positional and keyword arguments, programs)."""
    from . import gluon_lib

    T, K = x2.shape
    N = dy2.shape[1]
    x_desc = gluon_lib.descriptor(x2, [cfg.block_t, cfg.block_k])
    dy_desc = gluon_lib.descriptor(dy2, [cfg.block_t, cfg.block_n])
    programs = min(gluon_lib.sm_count(x2.device), triton_cdiv(N, cfg.block_n) * triton_cdiv(K, cfg.block_k))
    args = (x_desc, dy_desc, w_view, states.storage, states.scales, exports, seed, T, N, K, n_blocks(K))
    kwargs = dict(
        UPDATE=update, W_BF16=w_bf16, STOCHASTIC=rounding_code(rounding, K), LAYOUTS=states.layouts,
        NUM_PROGRAMS=programs, GROUP_N=cfg.group_n, STAGES=cfg.num_stages, SLICE_N=cfg.block_n // cfg.epilogue_split,
        EPILOGUE_WARPS=cfg.num_warps, PREFETCH=cfg.prefetch, MMA_WARPS=cfg.mma_warps,
        MMA_REGISTERS=cfg.mma_registers, MMA_SLICES=cfg.mma_slices,
    )
    compiled = gluon_lib.fused_ws[(programs,)](*args, **kwargs, num_warps=cfg.num_warps, maxnreg=cfg.launch_maxnreg)
    return compiled, args, kwargs, programs


def _device_guard(t):
    """Triton launches on the current CUDA device: a context that makes it the CUDA tensor `t`'s where it is
    not (a layer on another GPU than the current one), else nothing."""
    device = getattr(t, "device", None)
    if device is not None and device.type == "cuda" and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _reuse_key(spec, hypers: dict, x, dy, weight, state, rounding, tf32, config) -> Optional[tuple]:
    """(key, resolved keywords, spec) of a call that can reuse a prepared warp-specialized launch
    (forge_dsl/kernels/prepared.py), or None: reuse off, not a Hopper GPU, a layer below the warp-specialized
    kernel's size under the default config, or keywords the checked path must refuse (it raises, in its own
    order)."""
    if (not prepared.enabled() or not isinstance(weight, torch.Tensor) or not _hopper_with_gluon(weight.device)
            or (config is None and weight.numel() < WS_MIN_ELEMENTS)):
        return None
    try:
        resolved = _resolved_hypers(spec, hypers)
    except (ValueError, TypeError):
        return None
    module = compiled_module(spec)
    names = module.VARIANTS[resolved.variant][2]
    key = prepared.call_key(spec, resolved.variant, names, _scalar_names(spec), x, dy, weight, state, rounding, tf32,
                            config)
    return None if key is None else (key, resolved, spec)


def _scalar_names(spec) -> tuple[str, ...]:
    return tuple(s.name for s in spec.scalars)


def _launch_prepared(reuse: tuple, x, dy, weight, state, step, seed, auto: bool = False) -> bool:
    """Launch the call prepared under `reuse`'s key; False where there is none, or where `linear_step(path=
    "auto")` (`auto`) would not take the fused kernel for this metadata, or the entry cannot launch this step."""
    key, resolved, spec = reuse
    hit = prepared.lookup(key, spec)
    if hit is None:
        return False
    if auto:
        if hit.auto_path is None:
            hit.auto_path = _auto_path(x, dy, weight, state)
        if hit.auto_path != "fused":
            return False
    _check_step(step)
    with _device_guard(weight):
        scalar_updates = hit.launch(x, dy, weight, state, resolved.host_inputs, int(step), mix_seed(seed, step))
    if scalar_updates is None:
        return False
    _commit_scalars(state, scalar_updates)
    return True


def _prepare(reuse: tuple, spec, names: tuple[str, ...], state, cfg: TileConfig, compiled, args: tuple,
             kwargs: dict, programs: int) -> None:
    """Remember a checked warp-specialized launch under `reuse`'s key for later calls with the same metadata."""
    from .gluon_lib import fused_ws

    key, resolved, _ = reuse
    host = compiled_module(spec).VARIANTS[resolved.variant][0]
    try:
        entry = prepared.PreparedLaunch(spec, host, names, state, _scalar_names(spec),
                                        fused_ws, compiled, args, kwargs, programs,
                                        ([cfg.block_t, cfg.block_k], [cfg.block_t, cfg.block_n]))
    except prepared.NotReusable:  # every call of this layer stays checked
        return
    prepared.remember(key, entry)


SLAB_MIN_TOKENS = 4097  # `linear_step` takes the slab path from here (bf16 activations on CUDA, not on
# Hopper with Gluon) ...
SLAB_MIN_ELEMENTS = 2**24  # ... for layers this large (on k/v, 1024 × 4096, two runs disagreed)
SLAB_MIN_TOKENS_QUANTIZED = 2048  # with int8 state: from here, on every layer (docs/PERF.md, v5) ...
SLAB_MAX_TOKENS_QUANTIZED_WS = 512  # ... but up to here where the warp-specialized kernel runs and its launches
# are not reused (v9, v14)
SLAB_BYTES = 16 * 2**20  # the slab path's dW workspace: about a third of the H200's L2
SLAB_BYTES_QUANTIZED = 32 * 2**20  # with int8 state: two thirds of the L2, half the host's launches (PERF.md, v6)
LINEAR_PATHS = ("auto", "fused", "slab")


def linear_step(spec: SpecLike, x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor,
                state: MutableMapping[str, torch.Tensor], *, path: str = "auto", tf32: bool = False,
                config: Optional[TileConfig] = None, slab_bytes: Optional[int] = None, **kwargs: Any) -> None:
    """`fused_linear_step` or `slab_linear_step`, whichever is faster for this layer on this device.

    path "auto": what `auto_linear_path` decides for these arguments; "fused" / "slab" force one. The slab's
    dW is rounded to bf16, as autograd's is, and float32 products there follow torch's matmul precision
    instead of `tf32`; the fused kernel keeps dW in fp32. `config` goes to the fused kernel, `slab_bytes` to
    the slab path (default: by state layout, see `slab_linear_step`); other arguments as for
    `fused_linear_step`, whose reused launches skip the path decision too.
    """
    if path not in LINEAR_PATHS:
        raise ValueError(f"path must be one of {', '.join(LINEAR_PATHS)}, got {path!r}")
    if path != "slab" and "step" in kwargs and prepared.entries():  # a call prepared before: no checks, no path
        spec = load_spec(spec)
        hypers = dict(kwargs)
        step_, seed = hypers.pop("step"), hypers.pop("seed", DEFAULT_SEED)
        rounding = hypers.pop("rounding", DEFAULT_ROUNDING)
        reuse = _reuse_key(spec, hypers, x, dy, weight, state, rounding, tf32, config)
        if reuse is not None and _launch_prepared(reuse, x, dy, weight, state, step_, seed, auto=path == "auto"):
            return
    if path == "auto":
        path = _auto_path(x, dy, weight, state)
    if path == "slab":
        slab_linear_step(spec, x, dy, weight, state, slab_bytes=slab_bytes, **kwargs)
    else:
        fused_linear_step(spec, x, dy, weight, state, tf32=tf32, config=config, **kwargs)


def _auto_path(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor, state) -> str:
    """`auto_linear_path` of one `linear_step` call's arguments."""
    tokens = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    quantized = any(holds_codes(t) for t in state.values() if isinstance(t, torch.Tensor))
    tma = all(_tma_readable(t) for t in (x, dy))
    return auto_linear_path(tokens, weight.numel(), x.dtype, weight.device, quantized, tma=tma)


def auto_linear_path(tokens: int, elements: int, dtype: torch.dtype, device: torch.device,
                     quantized: bool = False, hopper: Optional[bool] = None, tma: bool = True,
                     reused: Optional[bool] = None) -> str:
    """"slab" or "fused": what `linear_step(path="auto")` runs for `tokens` activations of `dtype` on `device`,
    a weight of `elements` elements and int8 / uint8 state (`quantized`) or not; `hopper`: whether the device
    runs the warp-specialized fused kernel (default: ask it), `tma`: whether the activations can be read
    through TMA, `reused`: whether its launches are reused (default: `prepared.supported()`).

    The rules (why each holds: docs/PERF.md, the entry named): the fused kernel off CUDA and for float32
    activations; with quantized state where the warp-specialized kernel runs, the slab path up to
    `SLAB_MAX_TOKENS_QUANTIZED_WS` tokens unless launches are reused, else the fused kernel (v9, v14); with
    quantized state elsewhere, the slab path from `SLAB_MIN_TOKENS_QUANTIZED` tokens (v5); otherwise the
    fused kernel where the warp-specialized one runs (v7), and the slab path from `SLAB_MIN_TOKENS` tokens
    on layers of `SLAB_MIN_ELEMENTS` (v3)."""
    if device.type != "cuda" or dtype != torch.bfloat16:
        return "fused"
    if hopper is None:
        hopper = _hopper_with_gluon(device)
    if quantized:
        if hopper and tma and elements >= WS_MIN_ELEMENTS:
            if reused is None:
                reused = prepared.supported()
            return "slab" if tokens <= SLAB_MAX_TOKENS_QUANTIZED_WS and not reused else "fused"
        return "slab" if tokens >= SLAB_MIN_TOKENS_QUANTIZED else "fused"
    if hopper and tma:
        return "fused"
    return "slab" if tokens >= SLAB_MIN_TOKENS and elements >= SLAB_MIN_ELEMENTS else "fused"


def _tma_readable(t: torch.Tensor) -> bool:
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


def slab_linear_step(
    spec: SpecLike,
    x: torch.Tensor,
    dy: torch.Tensor,
    weight: torch.Tensor,
    state: MutableMapping[str, torch.Tensor],
    *,
    step: int,
    seed: int = 0,
    rounding: str = "stochastic",
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
    x2, dy2 = _check_linear(x, dy, weight, rounding)
    if slab_bytes is not None and (isinstance(slab_bytes, bool) or int(slab_bytes) != slab_bytes or slab_bytes < 1):
        raise ValueError(f"slab_bytes must be a positive integer or None, got {slab_bytes!r}")
    N, K = weight.shape
    update, names, exports, scalar_updates = _variant(spec, hypers, step, state)
    # Validated once for the whole tensors; each slab takes row slices of the same kernel arguments
    # (storage [N, K] and int8 scales [N, K / 64] alike), which keeps the host's cost per slab low.
    states = _prepare_state(spec, names, state, weight)
    if slab_bytes is None:
        slab_bytes = default_slab_bytes(any_quantized(states.layouts))
    if N == 0 or K == 0:
        _commit_scalars(state, scalar_updates)
        return
    rows = slab_rows(N, K, x2.element_size(), slab_bytes)
    workspace = torch.empty(rows, K, dtype=x2.dtype, device=weight.device)  # [rows, K]: one slab of dW
    key = mix_seed(seed, step)
    for r0 in range(0, N, rows):
        r1 = min(N, r0 + rows)
        grad = workspace[: r1 - r0]
        torch.matmul(dy2[:, r0:r1].t(), x2, out=grad)
        _launch_elementwise(update, weight[r0:r1], grad, states.rows(r0, r1), exports, mix_seed(key, r0), rounding)
    _commit_scalars(state, scalar_updates)


def default_slab_bytes(quantized: bool) -> int:
    """`slab_linear_step`'s dW budget when none is given: `SLAB_BYTES_QUANTIZED` with int8 / uint8 state
    (`quantized`), `SLAB_BYTES` otherwise."""
    return SLAB_BYTES_QUANTIZED if quantized else SLAB_BYTES


def slab_rows(N: int, K: int, element_size: int, slab_bytes: int) -> int:
    """Rows of dW [N, K] per slab of `slab_linear_step`: whole rows within `slab_bytes`, rounded down to a
    multiple of 128 where that leaves any (cuBLAS is slow on ragged M: 585 rows ran 4× slower than 512),
    at least one."""
    rows = max(1, min(N, int(slab_bytes) // (K * element_size)))
    return rows if rows < 128 or rows == N else rows // 128 * 128


def step(
    spec: SpecLike,
    param: torch.Tensor,
    grad: torch.Tensor,
    state: MutableMapping[str, torch.Tensor],
    *,
    step: int,
    seed: int = 0,
    rounding: str = "stochastic",
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
    if rounding not in _ROUNDINGS:
        raise ValueError(f"rounding must be one of {_ROUNDINGS}, got {rounding!r}")
    if grad.shape != param.shape:
        raise ValueError(f"grad has shape {tuple(grad.shape)} but param has {tuple(param.shape)}; they must match")
    if not param.is_contiguous():
        raise ValueError("param must be contiguous (it is updated in place)")
    for t, what in ((param, "param"), (grad, "grad")):
        _check_device(t, what)
        if t.device != param.device:
            raise ValueError(f"{what} is on {t.device} but param is on {param.device}")
    grad = grad.contiguous()
    _weight_view(param, "param")  # dtype checks before any other work
    _weight_view(grad, "grad")
    update, names, exports, scalar_updates = _variant(spec, hypers, step, state)
    states = _prepare_state(spec, names, state, param)
    rows, cols = as_rows(param).shape
    if rows * cols:
        _launch_elementwise(update, param, grad, states, exports, mix_seed(seed, step), rounding)
    _commit_scalars(state, scalar_updates)


def _launch_elementwise(update, param: torch.Tensor, grad: torch.Tensor, states: StateArgs, exports: tuple, key: int,
                        rounding: str) -> None:
    """One launch of the element-wise kernel (`tile_kernels.step`) with a variant's `update` over `param` viewed as
    rows (`grad` contiguous, same shape)."""
    from .tile_kernels import step as step_kernel  # triton is imported on first launch

    rows, cols = as_rows(param).shape
    p_view, p_bf16 = _weight_view(param, "param")
    g_view, g_bf16 = _weight_view(grad, "grad")
    block_n, block_k, num_warps = step_config(rows, cols, param.device)
    with _device_guard(param):
        step_kernel[(triton_cdiv(rows, block_n), triton_cdiv(cols, block_k))](
            p_view, g_view, states.storage, states.scales, exports,
            key, rows, cols, n_blocks(cols),
            UPDATE=update, W_BF16=p_bf16, G_BF16=g_bf16, STOCHASTIC=rounding_code(rounding, cols),
            LAYOUTS=states.layouts, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
        )


def rounding_code(rounding: str, n_cols: int) -> int:
    """`triton_lib.store_weight`'s STOCHASTIC for a weight of `n_cols` columns: "nearest" → 0
    (ROUND_NEAREST); "stochastic" → 2 (ROUND_STOCHASTIC_PAIRS, one hash per two neighbours) where every
    tile row starts at an even element index, i.e. `n_cols` is even (tiles start at even columns),
    else 1 (ROUND_STOCHASTIC). Both stochastic codes draw the same bits (`triton_lib.random16`)."""
    if rounding == "nearest":
        return 0
    return 2 if n_cols % 2 == 0 else 1


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
