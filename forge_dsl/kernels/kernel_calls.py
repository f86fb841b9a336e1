"""The kernels' launches, one function each, on checked arguments (`checks`) and a chosen config (`policy`).

    launch_fused(cfg, x2, dy2, weight, states, update, exports, key, rounding, tf32)
        `tile_kernels.fused` or, where `cfg` is warp-specialized, `gluon_lib.fused_ws`
    launch_elementwise(update, param, grad, states, exports, key, rounding)
        `tile_kernels.step`

`key` is the stochastic-rounding key (`mix_seed`), `update` / `exports` a variant's update function and
host scalars (`compiler.loader.compiled_variants`), `states` the bound state (`checks.StateArgs`). With
`host_in_table=n` (n >= 0), `exports` is instead a `host_table.HostTable` row holding n host scalars and the
key, which the kernel reads from device memory (`key` is then not read).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from ..spec.keywords import check_seed
from ..spec.scalar_ops import fp32
from .checks import StateArgs, tma_compatible, weight_view
from .layouts import FOUR_BIT_LAYOUTS, as_rows, n_blocks
from .policy import TileConfig, interpreting, step_config


def mix_seed(seed: int, step: int) -> int:
    """The key of `tile_lib.random_bits`, in [0, 2**31), from (seed, step): splitmix64 of both,
    so every step draws new bits. `seed` is any integer (its low 32 bits count; TypeError / ValueError
    naming it otherwise, `forge_dsl.spec.keywords.check_seed`); `step` a checked step number."""
    z = ((check_seed(seed) & 0xFFFFFFFF) << 32 | (int(step) & 0xFFFFFFFF)) + 0x9E3779B97F4A7C15
    z &= 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    z ^= z >> 31
    return z & 0x7FFFFFFF


def kernel_host_values(exports: tuple) -> tuple:
    """A variant's host scalars as every launch hands them to its kernel: each float rounded once to fp32, to
    nearest even (`spec.scalar_ops.fp32`: docs/LANGUAGE.md, section 6, says why); the ints and bools of
    runtime flags and integer host values as they are. Without it a compiled kernel rounds its fp32 arguments
    the same way, but the interpreter computed with a float64 beyond fp32's range (eps=1e-50 stayed 1e-50)."""
    return tuple(fp32(v) if type(v) is float else v for v in exports)


def launch_fused(cfg: TileConfig, x2: torch.Tensor, dy2: torch.Tensor, w_view: torch.Tensor, w_bf16: bool,
                 states: StateArgs, update, exports, key: int, rounding: str, tf32: bool,
                 host_in_table: int = -1) -> Optional[tuple]:
    """One launch of the fused kernel on x [T, K], dy [T, N] and the weight [N, K] (`w_view`, bf16 as int16).
    Returns what `reuse.PreparedLaunch` repeats of a warp-specialized launch (`launch_warp_specialized`),
    else None."""
    if cfg.warp_specialized:
        return launch_warp_specialized(cfg, x2, dy2, w_view, w_bf16, states, update, exports, key, rounding,
                                       host_in_table=host_in_table)
    from .tile_kernels import fused  # triton is imported on first launch

    T, K = x2.shape
    N = dy2.shape[1]
    dot_fp32 = interpreting() or x2.dtype == torch.float32
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
        key, T, N, K, n_blocks(K),
        x2.stride(0), x2.stride(1), dy2.stride(0), dy2.stride(1),
        **fused_constexprs(cfg, update, w_bf16, rounding_code(rounding, K), states.layouts, nibble_words(K, states),
                           dot_fp32, precision, tma, host_in_table),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=cfg.maxnreg,
    )
    return None


def fused_constexprs(cfg: TileConfig, update, w_bf16: bool, stochastic: int, layouts: tuple[int, ...], words: bool,
                     dot_fp32: bool, precision: Optional[str], tma: bool, host_in_table: int = -1) -> dict:
    """`tile_kernels.fused`'s constexpr arguments for `cfg` (its launches and `sm90.compile_fused` alike); `words`
    is `nibble_words`', `host_in_table` the kernel's HOST_IN_TABLE."""
    return dict(UPDATE=update, W_BF16=w_bf16, STOCHASTIC=stochastic, LAYOUTS=layouts, NIBBLE_WORDS=words,
                DOT_FP32=dot_fp32, INPUT_PRECISION=precision, BLOCK_T=cfg.block_t, BLOCK_N=cfg.block_n,
                BLOCK_K=cfg.block_k, GROUP_N=cfg.group_n, K_HALVES=cfg.k_halves, EPILOGUE_SPLIT=cfg.epilogue_split,
                TMA=tma, HOST_IN_TABLE=host_in_table)


def ws_constexprs(cfg: TileConfig, update, w_bf16: bool, stochastic: int, layouts: tuple[int, ...], words: bool,
                  programs: int, timeline_tiles: int = 0, host_in_table: int = -1) -> dict:
    """`gluon_lib.fused_ws`'s constexpr arguments for `cfg` and `programs` persistent programs (recording a
    timeline of `timeline_tiles` tiles per program where that is > 0); `words` is `nibble_words`',
    `host_in_table` the kernel's HOST_IN_TABLE."""
    return dict(UPDATE=update, W_BF16=w_bf16, STOCHASTIC=stochastic, LAYOUTS=layouts, NIBBLE_WORDS=words,
                NUM_PROGRAMS=programs, GROUP_N=cfg.group_n, STAGES=cfg.num_stages,
                SLICE_N=cfg.block_n // cfg.epilogue_split, EPILOGUE_WARPS=cfg.num_warps, PREFETCH=cfg.prefetch,
                MMA_WARPS=cfg.mma_warps, MMA_REGISTERS=cfg.mma_registers, MMA_SLICES=cfg.mma_slices,
                TIMELINE=timeline_tiles, HOST_IN_TABLE=host_in_table)


def launch_warp_specialized(cfg: TileConfig, x2, dy2, w_view, w_bf16: bool, states: StateArgs, update,
                             exports, seed: int, rounding: str, timeline: Optional[torch.Tensor] = None,
                             host_in_table: int = -1):
    """One launch of `gluon_lib.fused_ws`: one persistent program per SM (at most one per tile). Returns what
    `reuse.PreparedLaunch` repeats: (the compiled kernel, the positional and keyword arguments, programs).
    `timeline`: an int64 [programs, tiles, gluon_lib.TIMELINE_SLOTS] buffer the kernel records its partitions'
    waits in (`python -m forge_dsl.bench.ws_timeline`), its first dim the number of programs; None (the
    product) compiles none of it."""
    from . import gluon_lib

    T, K = x2.shape
    N = dy2.shape[1]
    x_desc = gluon_lib.descriptor(x2, [cfg.block_t, cfg.block_k])
    dy_desc = gluon_lib.descriptor(dy2, [cfg.block_t, cfg.block_n])
    programs = min(gluon_lib.sm_count(x2.device), triton_cdiv(N, cfg.block_n) * triton_cdiv(K, cfg.block_k))
    if timeline is not None and timeline.shape[0] != programs:
        raise ValueError(f"timeline must have one row per program ({programs}), got shape {tuple(timeline.shape)}")
    args = (x_desc, dy_desc, w_view, states.storage, states.scales, exports, seed, T, N, K, n_blocks(K),
            w_view if timeline is None else timeline)
    kwargs = ws_constexprs(cfg, update, w_bf16, rounding_code(rounding, K), states.layouts, nibble_words(K, states),
                           programs, 0 if timeline is None else timeline.shape[1], host_in_table)
    compiled = gluon_lib.fused_ws[(programs,)](*args, **kwargs, num_warps=cfg.num_warps, maxnreg=cfg.launch_maxnreg)
    return compiled, args, kwargs, programs



def launch_elementwise(update, param: torch.Tensor, grad: torch.Tensor, states: StateArgs, exports, key: int,
                        rounding: str, host_in_table: int = -1) -> None:
    """One launch of the element-wise kernel (`tile_kernels.step`) with a variant's `update` over `param` viewed as
    rows (`grad` contiguous, same shape)."""
    from .tile_kernels import step as step_kernel  # triton is imported on first launch

    rows, cols = as_rows(param).shape
    p_view, p_bf16 = weight_view(param, "param")
    g_view, g_bf16 = weight_view(grad, "grad")
    block_n, block_k, num_warps = step_config(rows, cols, param.device)
    with device_guard(param):
        step_kernel[(triton_cdiv(rows, block_n), triton_cdiv(cols, block_k))](
            p_view, g_view, states.storage, states.scales, exports,
            key, rows, cols, n_blocks(cols),
            UPDATE=update, W_BF16=p_bf16, G_BF16=g_bf16, STOCHASTIC=rounding_code(rounding, cols),
            LAYOUTS=states.layouts, NIBBLE_WORDS=nibble_words(cols, states), BLOCK_N=block_n, BLOCK_K=block_k,
            HOST_IN_TABLE=host_in_table, num_warps=num_warps,
        )


def rounding_code(rounding: str, n_cols: int) -> int:
    """`tile_lib.store_weight`'s STOCHASTIC for a weight of `n_cols` columns: "nearest" → 0
    (ROUND_NEAREST); "stochastic" → 2 (ROUND_STOCHASTIC_PAIRS, one hash per two neighbours) where every
    tile row starts at an even element index, i.e. `n_cols` is even (tiles start at even columns),
    else 1 (ROUND_STOCHASTIC). Both stochastic codes draw the same bits (`tile_lib.random16`)."""
    if rounding == "nearest":
        return 0
    return 2 if n_cols % 2 == 0 else 1


NIBBLE_WORDS_MAX_BYTES = 2**33  # 4-bit storage this large or larger is accessed by bytes: int32 word offsets


def nibble_words(n_cols: int, states: StateArgs) -> bool:
    """`state_lib`'s NIBBLE_WORDS for a launch on rows of `n_cols` columns: whether its 4-bit states are read and
    written a 32-bit word (8 codes) at a time. That needs every row of their packed storage to start on a word:
    `n_cols` a multiple of 8 (a row is n_cols / 2 bytes) and each 4-bit storage tensor starting on a 4-byte
    boundary (torch's allocations do; a view, e.g. `StateArgs.rows`' blocks, starts n_cols / 2 bytes times its
    first row past one); and word offsets that fit int32 (under `NIBBLE_WORDS_MAX_BYTES` each, 17 billion
    elements). Elsewhere the bytes, and False without 4-bit state, so that those launches compile one kernel
    whatever `n_cols`."""
    four = [t for t, code in zip(states.storage, states.layouts) if code in FOUR_BIT_LAYOUTS]
    return bool(four) and n_cols % 8 == 0 and all(
        t.data_ptr() % 4 == 0 and t.numel() < NIBBLE_WORDS_MAX_BYTES for t in four)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def device_guard(t):
    """Triton launches on the current CUDA device: a context that makes it the CUDA tensor `t`'s where it is
    not (a layer on another GPU than the current one), else nothing."""
    device = getattr(t, "device", None)
    if device is not None and device.type == "cuda" and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()

