"""The spec-independent Triton kernels: every spec's update runs in these, passed in as a jit function.

    fused[grid](X, DY, W, STATES, SCALES, HOST, seed, T, N, K, n_blocks, strides..., UPDATE=update, ...)
        dW tile = DY[T, N]ᵀ · X[T, K] accumulated over all tokens in fp32 registers, then the update
        of that tile of W [N, K] and its states straight from the accumulator (dW is never stored).
    step[grid](P, G, STATES, SCALES, HOST, seed, N, K, n_blocks, UPDATE=update, ...)
        the same update of P [N, K] from a materialized gradient G [N, K].

The warp-specialized fused kernel for Hopper (`gluon_lib.fused_ws`) runs the same `load_tile` /
`apply_tile` epilogue.

What a generated module (forge_dsl/compiler/templates/module.py.j2) contributes is the per-element program:

    update(b_param, b_grad, b_states, h, o_param, seed, W_BF16, STOCHASTIC) -> (b_param, b_states)

on fp32 register tiles of one shape (`b_states`: one tile per state the variant reads, in the order
of its `STATES` tuple), `h` the variant's host scalars (what its `host_v<i>` returns), and what the
weight's store rounds with (`tile_lib.store_weight`'s offsets, key and constexprs), which the spec's
`stored(x)` reads (`tile_lib.stored_weight`); `apply_tile` is the one call. The kernels take

    STATES  a tuple of each state's storage tensor (bf16 as its int16 view; int8 / uint8 codes),
    SCALES  a tuple of each state's block scales [N, K / 64] fp32 (int8 / uint8; the storage itself,
            never read, otherwise),
    HOST    the tuple of host scalars, handed to `UPDATE` as `h`; or, with HOST_IN_TABLE = n >= 0, a pointer to an
            int32 row [n + 1] in device memory: the fp32 bits of the n host scalars, then the seed, which the
            kernel reads there (`launch_values`) and ignores its `seed` argument (a launch replayed by a CUDA
            graph reads the values its host wrote for this step; `forge_dsl.kernels.host_table`),
    LAYOUTS a constexpr tuple of each state's layout code (`forge_dsl.kernels.layouts.StateLayout`), beside
            NIBBLE_WORDS, a constexpr: whether 4-bit states are read and written a 32-bit word (8 codes)
            at a time (`kernel_calls.nibble_words`),

and the weight as fp32, or bf16 as its int16 view (`W_BF16`). Every tuple may be empty (SGD).
"""

import triton
import triton.language as tl

from .state_lib import block_scale_offsets, decode_state, load_state_raw, store_state
from .tile_lib import (
    accumulate_dw,
    accumulate_dw_halves,
    decode_weight,
    load_weight,
    load_weight_raw,
    split_columns,
    store_weight,
    tile_at,
    tile_offsets,
)

__all__ = ["apply_tile", "fused", "launch_values", "load_tile", "step", "update_slice"]


@triton.jit
def launch_values(HOST, seed, HOST_IN_TABLE: tl.constexpr):
    """(host scalars, seed) of a launch: `HOST` and `seed` as passed where HOST_IN_TABLE < 0; else read from the
    int32 row `HOST` points to (HOST_IN_TABLE fp32 bit patterns, then the seed)."""
    if HOST_IN_TABLE < 0:
        return HOST, seed
    else:
        values = ()
        for i in tl.static_range(HOST_IN_TABLE):
            values = values + (tl.load(HOST + i).to(tl.float32, bitcast=True), )
        return values, tl.load(HOST + HOST_IN_TABLE)


@triton.jit
def load_tile(W, STATES, SCALES, offs, mask, scale_offs, W_BF16: tl.constexpr, LAYOUTS: tl.constexpr,
              NIBBLE_WORDS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Issue the loads of one [BLOCK_N, BLOCK_K] tile's weights and states, in storage types:
    (weight tile, tuple of state tiles, tuple of their scales; `state_lib.load_state_raw`)."""
    r_param = load_weight_raw(W, offs, mask, W_BF16)  # [BN, BK]
    raws = ()
    scales = ()
    for i in tl.static_range(len(STATES)):
        raw, scale = load_state_raw(STATES[i], SCALES[i], offs, mask, scale_offs, LAYOUTS[i], NIBBLE_WORDS, BLOCK_N,
                                    BLOCK_K)
        raws = raws + (raw, )
        scales = scales + (scale, )
    return r_param, raws, scales


@triton.jit
def apply_tile(W, STATES, SCALES, HOST, b_grad, r_param, raws, scales, offs, mask, scale_offs, seed,
               UPDATE: tl.constexpr, W_BF16: tl.constexpr, STOCHASTIC: tl.constexpr, LAYOUTS: tl.constexpr,
               NIBBLE_WORDS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The epilogue of one tile: decode what `load_tile` loaded, update from b_grad [BN, BK] fp32 in registers,
    store the weights and states."""
    b_param = decode_weight(r_param, W_BF16)  # [BN, BK] fp32
    b_states = ()
    for i in tl.static_range(len(STATES)):
        b_states = b_states + (decode_state(raws[i], scales[i], LAYOUTS[i], NIBBLE_WORDS, BLOCK_N, BLOCK_K), )
    b_param, b_states = UPDATE(b_param, b_grad, b_states, HOST, offs, seed, W_BF16, STOCHASTIC)
    store_weight(W, b_param, offs, mask, seed, W_BF16, STOCHASTIC)
    for i in tl.static_range(len(STATES)):
        store_state(STATES[i], SCALES[i], b_states[i], offs, mask, scale_offs, LAYOUTS[i], NIBBLE_WORDS, BLOCK_N,
                    BLOCK_K)


@triton.jit
def update_slice(W, STATES, SCALES, HOST, acc, offs_n, k_start, N, K, n_blocks, seed, UPDATE: tl.constexpr,
                 W_BF16: tl.constexpr, STOCHASTIC: tl.constexpr, LAYOUTS: tl.constexpr, NIBBLE_WORDS: tl.constexpr,
                 BLOCK_N: tl.constexpr, SLICE_K: tl.constexpr):
    """The epilogue of one column slice of a tile: acc [BN, SLICE_K] is dW for columns k_start + [0, SLICE_K);
    load their weights and states, update, store."""
    offs, mask = tile_offsets(offs_n, k_start + tl.arange(0, SLICE_K), N, K)
    scale_offs = block_scale_offsets(offs_n, k_start, n_blocks, SLICE_K)  # [BN, SLICE_K // 64] (int8 state)
    r_param, raws, scales = load_tile(W, STATES, SCALES, offs, mask, scale_offs, W_BF16, LAYOUTS, NIBBLE_WORDS,
                                      BLOCK_N, SLICE_K)
    apply_tile(W, STATES, SCALES, HOST, acc, r_param, raws, scales, offs, mask, scale_offs, seed, UPDATE, W_BF16,
               STOCHASTIC, LAYOUTS, NIBBLE_WORDS, BLOCK_N, SLICE_K)


@triton.jit(do_not_specialize=["seed", "T"])
def fused(
    X, DY, W, STATES, SCALES, HOST, seed, T, N, K, n_blocks,
    stride_xt, stride_xk, stride_dyt, stride_dyn,
    UPDATE: tl.constexpr, W_BF16: tl.constexpr, STOCHASTIC: tl.constexpr, LAYOUTS: tl.constexpr,
    NIBBLE_WORDS: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
    K_HALVES: tl.constexpr, EPILOGUE_SPLIT: tl.constexpr, TMA: tl.constexpr, HOST_IN_TABLE: tl.constexpr = -1,
):
    """W[N, K] -= update(dW) for one [BLOCK_N, BLOCK_K] tile, dW = DY[T, N]ᵀ · X[T, K] never stored.

    EPILOGUE_SPLIT 1: the tile's weights and state are loaded into registers before the token loop.
    EPILOGUE_SPLIT 2 or 4: the epilogue runs on that many column slices of the tile, one at a time
    (load, update, store), so it holds the registers of a slice beside the accumulator, not of the
    whole tile; the accumulator is split in registers (`split_columns`).
    K_HALVES: the tile is accumulated as two column halves (two dots per token block; EPILOGUE_SPLIT
    2 or 4).
    TMA: X and DY are Hopper TMA descriptors (blocks [BLOCK_T, BLOCK_K, or BLOCK_K / 2 with
    K_HALVES] and [BLOCK_T, BLOCK_N]).
    """
    HOST, seed = launch_values(HOST, seed, HOST_IN_TABLE)
    offs_n, offs_k, n_start, k_start = tile_at(tl.program_id(0), N, K, BLOCK_N, BLOCK_K, GROUP_N)
    if EPILOGUE_SPLIT == 1:
        tl.static_assert(not K_HALVES, "K_HALVES needs EPILOGUE_SPLIT 2 or 4")
        offs, mask = tile_offsets(offs_n, offs_k, N, K)
        scale_offs = block_scale_offsets(offs_n, k_start, n_blocks, BLOCK_K)  # [BN, BK // 64] (int8 state)
        # The tile's weights and state are loaded first, so their latency hides behind the token loop.
        r_param, raws, scales = load_tile(W, STATES, SCALES, offs, mask, scale_offs, W_BF16, LAYOUTS, NIBBLE_WORDS,
                                          BLOCK_N, BLOCK_K)
        # The token loop: the gradient tile lives only in these fp32 registers.
        acc = accumulate_dw(
            X, DY, n_start, k_start, T, N, K, stride_xt, stride_xk, stride_dyt, stride_dyn,
            DOT_FP32, INPUT_PRECISION, TMA, BLOCK_T, BLOCK_N, BLOCK_K,
        )  # [BN, BK]
        # The epilogue: the optimizer update straight from the accumulator.
        apply_tile(W, STATES, SCALES, HOST, acc, r_param, raws, scales, offs, mask, scale_offs, seed, UPDATE,
                   W_BF16, STOCHASTIC, LAYOUTS, NIBBLE_WORDS, BLOCK_N, BLOCK_K)
    else:
        SLICE_K: tl.constexpr = BLOCK_K // EPILOGUE_SPLIT
        if K_HALVES:
            acc_a, acc_b = accumulate_dw_halves(
                X, DY, n_start, k_start, T, N, K, stride_xt, stride_xk, stride_dyt, stride_dyn,
                DOT_FP32, INPUT_PRECISION, TMA, BLOCK_T, BLOCK_N, BLOCK_K // 2,
            )  # [BN, BK/2] each
        else:
            acc = accumulate_dw(
                X, DY, n_start, k_start, T, N, K, stride_xt, stride_xk, stride_dyt, stride_dyn,
                DOT_FP32, INPUT_PRECISION, TMA, BLOCK_T, BLOCK_N, BLOCK_K,
            )  # [BN, BK]
            acc_a, acc_b = split_columns(acc, BLOCK_N, BLOCK_K)  # [BN, BK/2] each
        # The epilogue, one slice at a time: load, update, store.
        if EPILOGUE_SPLIT == 2:
            update_slice(W, STATES, SCALES, HOST, acc_a, offs_n, k_start, N, K, n_blocks, seed, UPDATE, W_BF16,
                         STOCHASTIC, LAYOUTS, NIBBLE_WORDS, BLOCK_N, SLICE_K)
            update_slice(W, STATES, SCALES, HOST, acc_b, offs_n, k_start + SLICE_K, N, K, n_blocks, seed, UPDATE,
                         W_BF16, STOCHASTIC, LAYOUTS, NIBBLE_WORDS, BLOCK_N, SLICE_K)
        else:
            tl.static_assert(EPILOGUE_SPLIT == 4, "EPILOGUE_SPLIT must be 1, 2 or 4")
            acc_0, acc_1 = split_columns(acc_a, BLOCK_N, BLOCK_K // 2)  # [BN, BK/4] each
            acc_2, acc_3 = split_columns(acc_b, BLOCK_N, BLOCK_K // 2)
            update_slice(W, STATES, SCALES, HOST, acc_0, offs_n, k_start, N, K, n_blocks, seed, UPDATE, W_BF16,
                         STOCHASTIC, LAYOUTS, NIBBLE_WORDS, BLOCK_N, SLICE_K)
            update_slice(W, STATES, SCALES, HOST, acc_1, offs_n, k_start + SLICE_K, N, K, n_blocks, seed, UPDATE,
                         W_BF16, STOCHASTIC, LAYOUTS, NIBBLE_WORDS, BLOCK_N, SLICE_K)
            update_slice(W, STATES, SCALES, HOST, acc_2, offs_n, k_start + 2 * SLICE_K, N, K, n_blocks, seed,
                         UPDATE, W_BF16, STOCHASTIC, LAYOUTS, NIBBLE_WORDS, BLOCK_N, SLICE_K)
            update_slice(W, STATES, SCALES, HOST, acc_3, offs_n, k_start + 3 * SLICE_K, N, K, n_blocks, seed,
                         UPDATE, W_BF16, STOCHASTIC, LAYOUTS, NIBBLE_WORDS, BLOCK_N, SLICE_K)


@triton.jit(do_not_specialize=["seed"])
def step(
    P, G, STATES, SCALES, HOST, seed, N, K, n_blocks,
    UPDATE: tl.constexpr, W_BF16: tl.constexpr, G_BF16: tl.constexpr, STOCHASTIC: tl.constexpr,
    LAYOUTS: tl.constexpr, NIBBLE_WORDS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HOST_IN_TABLE: tl.constexpr = -1,
):
    """P[N, K] -= update(G[N, K]) for one [BLOCK_N, BLOCK_K] tile (a parameter viewed as rows)."""
    HOST, seed = launch_values(HOST, seed, HOST_IN_TABLE)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(1) * BLOCK_K
    offs, mask = tile_offsets(offs_n, k_start + tl.arange(0, BLOCK_K), N, K)
    scale_offs = block_scale_offsets(offs_n, k_start, n_blocks, BLOCK_K)  # [BN, BK // 64] (int8 state)
    b_grad = load_weight(G, offs, mask, G_BF16)  # [BN, BK] fp32
    r_param, raws, scales = load_tile(P, STATES, SCALES, offs, mask, scale_offs, W_BF16, LAYOUTS, NIBBLE_WORDS,
                                      BLOCK_N, BLOCK_K)
    apply_tile(P, STATES, SCALES, HOST, b_grad, r_param, raws, scales, offs, mask, scale_offs, seed, UPDATE, W_BF16,
               STOCHASTIC, LAYOUTS, NIBBLE_WORDS, BLOCK_N, BLOCK_K)
