"""Launch policy of the kernels, as data: the tile configs the fused kernel runs, which one a layer gets,
the element-wise kernel's tiles, and which path (`fused` or `slab`) `linear_step(path="auto")` takes.

Every rule here comes from a measurement on the H200; each names the `docs/PERF.md` entry that holds it.
Nothing here looks at tensors: the functions take shapes, dtypes and facts about the device, so a
benchmark can ask what a layer would get on a machine it is not running on (`hopper=True`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Optional

import torch

from ..interpreter import interpreting
from .layouts import storage_dtype

__all__ = ["TileConfig", "fused_config", "step_config", "auto_linear_path", "LINEAR_PATHS", "slab_rows",
           "default_slab_bytes", "stored_bytes", "hopper_with_gluon", "interpreting"]


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


# The fused kernel's tile configs (`fused_config` picks one; the PERF.md entries that measured them).
INTERPRETER_TILES = TileConfig(block_t=64, block_n=64, block_k=64, num_warps=4, num_stages=1)  # few programs
FP32_TILES = TileConfig(block_t=64, block_n=64, block_k=64, num_warps=4, num_stages=4)  # v2: fp32 blocks are twice
# the shared memory
# the warp-specialized kernel (v7, v9): 8 MMA and 8 epilogue warps on 32-row slices, a WS_STAGES-buffer TMA ring
WS_TILES = TileConfig(block_t=64, block_n=128, block_k=128, num_warps=8, num_stages=5, tma=True, epilogue_split=4,
                      mma_warps=8)
QUANTIZED_TILES = TileConfig(block_t=64, block_n=128, block_k=64, num_warps=8, num_stages=4, tma=True,
                             maxnreg=128)  # v5: int8 state up to QUANTIZED_WIDE_MIN_TOKENS tokens, two per SM
QUANTIZED_WIDE_TILES = TileConfig(block_t=64, block_n=128, block_k=128, num_warps=8, num_stages=4)  # v3 (+ TMA on
# layers of LARGE_ELEMENTS)
SMALL_TILES = TileConfig(block_t=64, block_n=64, block_k=64, num_warps=4, num_stages=4)  # v2, v5 (+ TMA on layers
# of LARGE_ELEMENTS)
LARGE_TILES = TileConfig(block_t=64, block_n=128, block_k=128, num_warps=8, num_stages=3, tma=True, epilogue_split=4,
                         maxnreg=128)  # v2 to v4: a quarter-slice epilogue capped at 128 registers

WS_STAGES = WS_TILES.num_stages  # 5 ring buffers of 32 KiB beside the 64 KiB dW tile: 224 of the SM's 227 KiB
# (v12e, v13a: one buffer more than v7's 4 took 1-4 % off at 2048 tokens on every Llama-3.1-8B shape)
WS_MIN_ELEMENTS = 2**22  # the warp-specialized kernel from here: 256 tiles of 128×128 for 132 SMs
WS_PREFETCH_MAX_BYTES = 6  # its epilogue's prefetch fits its registers up to this many bytes per element (v7, v9)
WS_MMA_SLICE_MAX_TOKENS = 512  # up to this T, its MMA warps update one of each tile's four slices (v8, v9)
QUANTIZED_WIDE_MIN_TOKENS = 4097  # int8 state: QUANTIZED_WIDE_TILES from here (v3, v5)
LARGE_ELEMENTS = 2**24  # "large" layers: the small tiles up to SMALL_MAX_TOKENS, TMA on the wide int8 tiles
SMALL_MAX_TOKENS = 512  # on large layers, SMALL_TILES up to here (v2, v5) ...
SMALL_MAX_TOKENS_MID = 1024  # ... and up to here on layers under MID_ELEMENTS
MID_ELEMENTS = 2**22


@functools.lru_cache(maxsize=1024)  # called on every step with the same arguments; TileConfig is frozen
def fused_config(T: int, N: int, K: int, device: torch.device, quantized: bool = False,
                 activations: torch.dtype = torch.bfloat16, warp_specialize: bool = True,
                 hopper: Optional[bool] = None, stored_bytes: int = 6) -> TileConfig:
    """The fused kernel's tiles for T tokens on a weight [N, K] on `device`, the rules in the order applied:

    * off CUDA (the interpreter): `INTERPRETER_TILES`; float32 activations: `FP32_TILES`.
    * Hopper with Gluon (`hopper`, default: ask `device`), bf16 activations a TMA descriptor can read
      (`warp_specialize`), layers of at least `WS_MIN_ELEMENTS`: `WS_TILES`, whose epilogue prefetches the
      next slice where weights and state take at most `WS_PREFETCH_MAX_BYTES` per element (`stored_bytes`)
      and the state is not quantized; up to `WS_MMA_SLICE_MAX_TOKENS` tokens, with the prefetch or
      quantized state, its MMA warps update one slice of each tile.
    * int8 / uint8 state (`quantized`): `QUANTIZED_TILES` below `QUANTIZED_WIDE_MIN_TOKENS`, else
      `QUANTIZED_WIDE_TILES`.
    * `SMALL_TILES` up to `SMALL_MAX_TOKENS` on layers of `LARGE_ELEMENTS` and more, and up to
      `SMALL_MAX_TOKENS_MID` under `MID_ELEMENTS`; otherwise `LARGE_TILES`.
    """
    if device.type != "cuda":
        return INTERPRETER_TILES
    if activations == torch.float32:
        return FP32_TILES
    large = N * K >= LARGE_ELEMENTS
    if hopper is None:
        hopper = hopper_with_gluon(device)
    if warp_specialize and hopper and N * K >= WS_MIN_ELEMENTS:
        prefetch = stored_bytes <= WS_PREFETCH_MAX_BYTES and not quantized
        slices = 1 if (prefetch or quantized) and T <= WS_MMA_SLICE_MAX_TOKENS else 0
        return dataclasses.replace(WS_TILES, prefetch=prefetch, mma_slices=slices)
    if quantized:
        if T < QUANTIZED_WIDE_MIN_TOKENS:
            return QUANTIZED_TILES
        return dataclasses.replace(QUANTIZED_WIDE_TILES, tma=large)
    if (T <= SMALL_MAX_TOKENS and large) or (T <= SMALL_MAX_TOKENS_MID and N * K < MID_ELEMENTS):
        return dataclasses.replace(SMALL_TILES, tma=large)
    return LARGE_TILES


def stored_bytes(w_bf16: bool, layouts: tuple[int, ...]) -> int:
    """Bytes per element of a weight (bf16 or fp32) and its states (their layout codes)."""
    return (2 if w_bf16 else 4) + sum(storage_dtype(code).itemsize for code in layouts)


def hopper_with_gluon(device: torch.device) -> bool:
    """Whether `gluon_lib.fused_ws` runs on `device`: a Hopper GPU (sm_90), a Triton with Gluon, no interpreter."""
    if device.type != "cuda" or interpreting():
        return False
    return _hopper_gpu_with_gluon(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _hopper_gpu_with_gluon(index: int) -> bool:
    """`hopper_with_gluon` of CUDA device `index`, asked once (a few tens of µs a call otherwise, on every step)."""
    from . import gluon_lib

    return gluon_lib.AVAILABLE and torch.cuda.is_available() and torch.cuda.get_device_capability(index)[0] == 9


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



LINEAR_PATHS = ("auto", "fused", "slab")
SLAB_MIN_TOKENS = 4097  # `linear_step` takes the slab path from here (bf16 activations on CUDA, not on
# Hopper with Gluon) ...
SLAB_MIN_ELEMENTS = 2**24  # ... for layers this large (on k/v, 1024 × 4096, two runs disagreed) (v3)
SLAB_MIN_TOKENS_QUANTIZED = 2048  # with int8 state: from here, on every layer (v5) ...
SLAB_MAX_TOKENS_QUANTIZED_WS = 512  # ... but up to here where the warp-specialized kernel runs and its launches
# are not reused (v9, v14)
SLAB_BYTES = 16 * 2**20  # the slab path's dW workspace: about a third of the H200's L2
SLAB_BYTES_QUANTIZED = 32 * 2**20  # with int8 state: two thirds of the L2, half the host's launches (v6)


def auto_linear_path(tokens: int, elements: int, dtype: torch.dtype, device: torch.device,
                     quantized: bool = False, hopper: Optional[bool] = None, tma: bool = True,
                     reused: Optional[bool] = None) -> str:
    """"slab" or "fused": what `linear_step(path="auto")` runs for `tokens` activations of `dtype` on `device`,
    a weight of `elements` elements and int8 / uint8 state (`quantized`) or not; `hopper`: whether the device
    runs the warp-specialized fused kernel (default: ask it), `tma`: whether the activations can be read
    through TMA, `reused`: whether its launches are reused (default: `reuse.supported()`).

    The rules: the fused kernel off CUDA and for float32 activations; with quantized state where the
    warp-specialized kernel runs, the slab path up to `SLAB_MAX_TOKENS_QUANTIZED_WS` tokens unless launches
    are reused, else the fused kernel; with quantized state elsewhere, the slab path from
    `SLAB_MIN_TOKENS_QUANTIZED` tokens; otherwise the fused kernel where the warp-specialized one runs (v7),
    and the slab path from `SLAB_MIN_TOKENS` tokens on layers of `SLAB_MIN_ELEMENTS`."""
    if device.type != "cuda" or dtype != torch.bfloat16:
        return "fused"
    if hopper is None:
        hopper = hopper_with_gluon(device)
    if quantized:
        if hopper and tma and elements >= WS_MIN_ELEMENTS:
            if reused is None:
                from . import reuse

                reused = reuse.supported()
            return "slab" if tokens <= SLAB_MAX_TOKENS_QUANTIZED_WS and not reused else "fused"
        return "slab" if tokens >= SLAB_MIN_TOKENS_QUANTIZED else "fused"
    if hopper and tma:
        return "fused"
    return "slab" if tokens >= SLAB_MIN_TOKENS and elements >= SLAB_MIN_ELEMENTS else "fused"


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

