"""The warp-specialized fused kernel, in Gluon, for Hopper GPUs (sm_90): `fused_ws`.

The Triton fused kernel (`tile_kernels.fused`) runs its token loop and its epilogue in the same warps, one
after the other: the tensor cores wait while a tile's weights and state are updated (docs/PERF.md, v4).
`fused_ws` takes the same arguments (a spec's update passed in as `UPDATE`) and gives each SM one
persistent program of three partitions that work on different tiles at once:

  `ws_loader`   (1 warp)   TMA copies of DY [BLOCK_T, BN] and X [BLOCK_T, BK] blocks into a ring of
                           STAGES shared-memory buffers (`ready` / `empty` barriers per buffer);
  `ws_mma`      (MMA_WARPS) wgmma: acc [BN, BK] fp32 += DY blockᵀ · X block over every token block
                           (`ws_accumulate`), then the finished tile goes to shared memory (`acc_smem`,
                           64 KiB, `ws_hand_over`); with MMA_SLICES > 0 it updates the tile's last
                           MMA_SLICES row slices itself (where the token loop is shorter than the
                           epilogue), then starts its next tile;
  `ws_epilogue` (the kernel's num_warps) reads `acc_smem` in [SLICE_N, BK] row slices (the others) and
                           applies `tile_kernels.load_tile` / `apply_tile` (the Triton kernels' epilogue).

Tiles are 128 × 128 (BN × BK), visited by every partition in the same order: tile `program_id +
i · NUM_PROGRAMS`, grouped as `tile_lib.grouped_tile` orders them. The dW tile exists only in the
mma partition's registers and in `acc_smem`, never in global memory.

Each `mbarrier.arrive` below is made by one thread for its whole partition; the compiler puts a barrier
of the partition's warps in front of it (`bar.sync <id>, <threads>` in the PTX of Triton 3.6, checked
with `python -m forge_dsl.bench.sm90`), so every warp's reads of a buffer are done before it is
handed back.

Gluon is Triton's lower-level dialect (`triton.experimental.gluon`, Triton ≥ 3.6 here). It has no
interpreter, so these kernels run only compiled on a GPU; `AVAILABLE` is False where this Triton
lacks it, and then `fused_ws` is None (`policy.fused_config` never picks it).
"""


import functools

import triton
import triton.language as tl

from .tile_kernels import apply_tile, launch_values, load_tile
from .tile_lib import grouped_tile

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

    # Triton 3.6 names the TMA load `async_copy_global_to_shared`; later versions `async_load`.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    AVAILABLE = hasattr(gl, "warp_specialize") and tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 6)
except ImportError:  # an older Triton: the Triton kernels only
    gluon = gl = mbarrier = None
    AVAILABLE = False

__all__ = ["AVAILABLE", "descriptor", "fused_ws", "gl", "gluon_jit", "mbarrier", "shared_layout", "sm_count",
           "ws_allocate", "ws_accumulate", "ws_epilogue", "ws_hand_over", "ws_loader", "ws_mma", "ws_read_slice",
           "ws_row_slice", "ws_slice_offsets", "ws_tile_start", "ws_tiles"]


def gluon_jit(fn=None, **kwargs):
    """`gluon.jit` where Gluon is available; otherwise the decorated kernel is None."""
    if not AVAILABLE:
        return None if fn is not None else (lambda f: None)
    return gluon.jit(fn, **kwargs) if fn is not None else gluon.jit(**kwargs)


def _constexpr_function(fn):
    return gluon.constexpr_function(fn) if AVAILABLE else fn


@_constexpr_function
def epilogue_layout(warps):
    """The epilogue's register layout of a [SLICE_N, 128] slice: 8 consecutive elements per thread
    (16-byte bf16 loads and stores), a warp on two rows, the warps stacked down the rows."""
    return gl.BlockedLayout([1, 8], [2, 16], [warps, 1], [1, 0])


@_constexpr_function
def mma_layout(warps, block_k):
    """The wgmma accumulator layout of `warps` warps (4 per 64 rows) over a [128, block_k] tile."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, block_k, 16])


TIMELINE_SLOTS = tl.constexpr(16)  # int64 stamps per (program, tile) of a recorded timeline; 11 used


@gluon_jit
def ws_clock():
    """The SM's cycle counter (%clock64), for a recorded timeline."""
    return gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon_jit
def ws_nanoseconds():
    """The GPU's global timer (%globaltimer, ns), for a recorded timeline."""
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon_jit
def ws_stamp(TL, j, slot: tl.constexpr, value, TIMELINE: tl.constexpr):
    """Record `value` in slot `slot` of this program's tile j: TL [programs, TIMELINE, TIMELINE_SLOTS] int64
    (tiles past TIMELINE are not recorded). Compiled only where the kernel records a timeline
    (TIMELINE > 0, `python -m forge_dsl.bench.ws_timeline`); the slots are listed there."""
    if TIMELINE > 0:
        if j < TIMELINE:
            gl.store(TL + (gl.program_id(0) * TIMELINE + j) * TIMELINE_SLOTS + slot, value)


@gluon_jit
def ws_stamp_clock(TL, j, slot: tl.constexpr, TIMELINE: tl.constexpr):
    """`ws_stamp` of the cycle counter, read only where the kernel records a timeline."""
    if TIMELINE > 0:
        ws_stamp(TL, j, slot, ws_clock(), TIMELINE)


@gluon_jit
def ws_stamp_nanoseconds(TL, j, slot: tl.constexpr, TIMELINE: tl.constexpr):
    """`ws_stamp` of the global timer, read only where the kernel records a timeline."""
    if TIMELINE > 0:
        ws_stamp(TL, j, slot, ws_nanoseconds(), TIMELINE)


@gluon_jit
def ws_tiles(N, K, BN: tl.constexpr, BK: tl.constexpr):
    """(first tile of this program, number of [BN, BK] tiles of W [N, K])."""
    return gl.program_id(0), gl.cdiv(N, BN) * gl.cdiv(K, BK)


@gluon_jit
def ws_tile_start(tile, N, K, BN: tl.constexpr, BK: tl.constexpr, GROUP_N: tl.constexpr):
    """(first row, first column) of tile number `tile` in grouped order."""
    pid_n, pid_k = grouped_tile(tile, N, K, BN, BK, GROUP_N)
    return pid_n * BN, pid_k * BK


@gluon_jit
def ws_allocate(X, DY, STAGES: tl.constexpr, MMA_SLICES: tl.constexpr):
    """Shared memory and barriers of one program: (x_bufs [STAGES, BT, BK] and dy_bufs [STAGES, BT, BN],
    the ring; acc_smem [BN, BK] fp32, the finished tile; ready, empty [STAGES] barriers of the ring;
    acc_ready, acc_empty, the barriers of acc_smem: acc_empty waits for the epilogue and, when it updates
    MMA_SLICES > 0 slices itself, for the mma partition too). X and DY are TMA descriptors."""
    BT: tl.constexpr = X.block_type.shape[0]
    BK: tl.constexpr = X.block_type.shape[1]
    BN: tl.constexpr = DY.block_type.shape[1]
    x_bufs = gl.allocate_shared_memory(X.dtype, [STAGES, BT, BK], X.layout)
    dy_bufs = gl.allocate_shared_memory(DY.dtype, [STAGES, BT, BN], DY.layout)
    acc_smem = gl.allocate_shared_memory(gl.float32, [BN, BK],
                                         gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[1, 0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    acc_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    acc_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    mbarrier.init(acc_ready, count=1)
    mbarrier.init(acc_empty, count=2 if MMA_SLICES > 0 else 1)
    return x_bufs, dy_bufs, acc_smem, ready, empty, acc_ready, acc_empty


@gluon_jit
def ws_loader(X, DY, x_bufs, dy_bufs, ready, empty, T, N, K, TL, NUM_PROGRAMS: tl.constexpr, GROUP_N: tl.constexpr,
              TIMELINE: tl.constexpr):
    """Worker partition (1 warp): for each tile and token block, wait for a free ring buffer and
    start the TMA copies of X[t0:+BT, k-block] and DY[t0:+BT, n-block] into it (rows past T read 0).
    Timeline: the cycles waited for free buffers, summed per tile (slot 8)."""
    BT: tl.constexpr = X.block_type.shape[0]
    BK: tl.constexpr = X.block_type.shape[1]
    BN: tl.constexpr = DY.block_type.shape[1]
    STAGES: tl.constexpr = x_bufs.type.shape[0]
    first, num_tiles = ws_tiles(N, K, BN, BK)
    it = 0
    j = 0
    for tile in range(first, num_tiles, NUM_PROGRAMS):
        n_start, k_start = ws_tile_start(tile, N, K, BN, BK, GROUP_N)
        if TIMELINE > 0:
            waited = ws_clock() * 0
        for t0 in range(0, T, BT):
            s = it % STAGES
            if TIMELINE > 0:
                c0 = ws_clock()
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            if TIMELINE > 0:
                waited += ws_clock() - c0
            mbarrier.expect(ready.index(s), X.block_type.nbytes + DY.block_type.nbytes)
            _tma_load(X, [t0, k_start], ready.index(s), x_bufs.index(s))
            _tma_load(DY, [t0, n_start], ready.index(s), dy_bufs.index(s))
            it += 1
        if TIMELINE > 0:
            ws_stamp(TL, j, 8, waited, TIMELINE)
        j += 1


@gluon_jit
def ws_accumulate(X, DY, x_bufs, dy_bufs, ready, empty, it, T, n_start, k_start, TL, j, TIMELINE: tl.constexpr):
    """In the mma partition (4 or 8 warps): (acc [BN, BK] fp32 = DY[:, n-block]ᵀ · X[:, k-block] over all T
    tokens, the ring position after them). wgmma with one asynchronous MMA in flight while the next block's
    copy lands; each ring buffer goes back to the loader once the MMA that read it is done. `it` counts the
    ring's blocks over all of the program's tiles (the ring's phase). Timeline: the cycles waited for filled
    buffers, summed over tile j's loop (slot 1)."""
    BT: tl.constexpr = X.block_type.shape[0]
    BK: tl.constexpr = X.block_type.shape[1]
    BN: tl.constexpr = DY.block_type.shape[1]
    STAGES: tl.constexpr = x_bufs.type.shape[0]
    acc = gl.zeros([BN, BK], gl.float32, mma_layout(gl.num_warps(), BK))
    if TIMELINE > 0:
        waited = ws_clock() * 0
    for t0 in range(0, T, BT):
        s = it % STAGES
        if TIMELINE > 0:
            c0 = ws_clock()
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        if TIMELINE > 0:
            waited += ws_clock() - c0
        acc = warpgroup_mma(dy_bufs.index(s).permute((1, 0)), x_bufs.index(s), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        # the MMA before this one has read its buffer: hand it back to the loader
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=t0 > 0)
        it += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=T > 0)
    if TIMELINE > 0:
        ws_stamp(TL, j, 1, waited, TIMELINE)
    return acc, it


@gluon_jit
def ws_hand_over(acc, acc_smem, acc_ready, acc_empty, j, TL, TIMELINE: tl.constexpr):
    """In the mma partition: wait until every reader of the program's tile j - 1 is done with acc_smem, store
    tile j's acc there and signal acc_ready. Timeline: acc_smem free (slot 3), tile j handed over (slot 4)."""
    mbarrier.wait(acc_empty, (j & 1) ^ 1)
    ws_stamp_clock(TL, j, 3, TIMELINE)
    acc_smem.store(acc)
    mbarrier.arrive(acc_ready)
    ws_stamp_clock(TL, j, 4, TIMELINE)


@gluon_jit
def ws_read_slice(acc_smem, acc_empty, r: tl.constexpr, LAST: tl.constexpr, SLICE_N: tl.constexpr,
                  EPILOGUE_WARPS: tl.constexpr):
    """Rows [r·SLICE_N, +SLICE_N) of the finished tile, [SLICE_N, BK] fp32 in `epilogue_layout`; after
    slice LAST, the last this partition reads, it tells the mma partition (acc_empty) it is done with the tile."""
    b_grad = acc_smem.slice(r * SLICE_N, SLICE_N, dim=0).load(epilogue_layout(EPILOGUE_WARPS))
    if r == LAST:
        mbarrier.arrive(acc_empty)
    return b_grad


@gluon_jit
def ws_slice_offsets(n_start, k_start, N, K, n_blocks, SLICE_N: tl.constexpr, BK: tl.constexpr,
                     EPILOGUE_WARPS: tl.constexpr):
    """Where the slice rows n_start + [0, SLICE_N), columns k_start + [0, BK) live, in `epilogue_layout`:
    (offs [SLICE_N, BK] int64 and mask [SLICE_N, BK], as `tile_lib.tile_offsets`; scale_offs
    [SLICE_N, BK // 64] int64, as `state_lib.block_scale_offsets`, for int8 state's block scales).

    scale_offs is reduced from per-element values over each 64-column block, the same reshape the state
    helpers make of the mask and of each block's maximum, so its layout is theirs (Gluon combines only
    tensors of one layout); its slice-local part is the same for every slice. Without int8 state it is
    never used, and the compiled kernel does not compute it (adding it left that PTX unchanged,
    checked offline at 52261df)."""
    layout: tl.constexpr = epilogue_layout(EPILOGUE_WARPS)
    rows = gl.arange(0, SLICE_N, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, BK, layout=gl.SliceLayout(0, layout))
    offs_n = n_start + rows
    offs_k = k_start + cols
    offs = offs_n.to(gl.int64)[:, None] * K + offs_k.to(gl.int64)[None, :]
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    local = rows[:, None] * n_blocks + (cols // 64)[None, :]  # [SLICE_N, BK] int32: < SLICE_N * n_blocks + 2
    local = gl.max(gl.reshape(local, [SLICE_N, BK // 64, 64]), axis=2)  # [SLICE_N, BK // 64]
    scale_offs = (n_start.to(gl.int64) * n_blocks + k_start // 64) + local.to(gl.int64)
    return offs, mask, scale_offs


@gluon_jit
def ws_row_slice(W, STATES, SCALES, HOST, b_grad, n_start, k_start, N, K, n_blocks, seed, UPDATE: tl.constexpr,
                 W_BF16: tl.constexpr, STOCHASTIC: tl.constexpr, LAYOUTS: tl.constexpr, NIBBLE_WORDS: tl.constexpr,
                 SLICE_N: tl.constexpr, BK: tl.constexpr, WARPS: tl.constexpr):
    """The update of rows n_start + [0, SLICE_N), columns k_start + [0, BK) from their dW b_grad [SLICE_N, BK]
    fp32 (in `epilogue_layout(WARPS)`): load the weights and states, update, store. For either partition of
    `fused_ws` that updates a row slice without prefetching it."""
    offs, mask, scale_offs = ws_slice_offsets(n_start, k_start, N, K, n_blocks, SLICE_N, BK, WARPS)
    r_param, raws, scales = load_tile(W, STATES, SCALES, offs, mask, scale_offs, W_BF16, LAYOUTS, NIBBLE_WORDS,
                                      SLICE_N, BK)
    apply_tile(W, STATES, SCALES, HOST, b_grad, r_param, raws, scales, offs, mask, scale_offs, seed, UPDATE, W_BF16,
               STOCHASTIC, LAYOUTS, NIBBLE_WORDS, SLICE_N, BK)


@gluon_jit
def ws_epilogue(W, STATES, SCALES, HOST, acc_smem, acc_ready, acc_empty, seed, N, K, n_blocks, TL,
                UPDATE: tl.constexpr, W_BF16: tl.constexpr, STOCHASTIC: tl.constexpr, LAYOUTS: tl.constexpr,
                NIBBLE_WORDS: tl.constexpr, NUM_PROGRAMS: tl.constexpr, GROUP_N: tl.constexpr,
                SLICE_N: tl.constexpr, EPILOGUE_WARPS: tl.constexpr, PREFETCH: tl.constexpr,
                MMA_SLICES: tl.constexpr, TIMELINE: tl.constexpr, HOST_IN_TABLE: tl.constexpr):
    """The epilogue partition of `fused_ws`: for each of this program's tiles, wait for its dW in acc_smem
    [BN, BK], then update its weights and states a [SLICE_N, BK] row slice at a time (all but the last
    MMA_SLICES, which `ws_mma` updates). PREFETCH: each slice's loads go out before the update of the slice
    before it (the first slice's, before the tile's dW is ready), so the memory system always has a slice in
    flight (more registers). Timeline: before waiting for tile j (slot 5), tile j ready (6), tile j done (7,
    and the global timer in 10)."""
    HOST, seed = launch_values(HOST, seed, HOST_IN_TABLE)
    BN: tl.constexpr = acc_smem.type.shape[0]
    BK: tl.constexpr = acc_smem.type.shape[1]
    SLICES: tl.constexpr = BN // SLICE_N - MMA_SLICES  # this partition's, per tile
    first, num_tiles = ws_tiles(N, K, BN, BK)
    j = 0
    for tile in range(first, num_tiles, NUM_PROGRAMS):
        n_start, k_start = ws_tile_start(tile, N, K, BN, BK, GROUP_N)
        if PREFETCH:
            offs, mask, scale_offs = ws_slice_offsets(n_start, k_start, N, K, n_blocks, SLICE_N, BK, EPILOGUE_WARPS)
            r_param, raws, scales = load_tile(W, STATES, SCALES, offs, mask, scale_offs, W_BF16, LAYOUTS,
                                              NIBBLE_WORDS, SLICE_N, BK)
        ws_stamp_clock(TL, j, 5, TIMELINE)
        mbarrier.wait(acc_ready, j & 1)
        ws_stamp_clock(TL, j, 6, TIMELINE)
        for r in tl.static_range(SLICES):
            acc = ws_read_slice(acc_smem, acc_empty, r, SLICES - 1, SLICE_N, EPILOGUE_WARPS)  # [SLICE_N, BK] fp32
            if not PREFETCH:
                ws_row_slice(W, STATES, SCALES, HOST, acc, n_start + r * SLICE_N, k_start, N, K, n_blocks, seed,
                             UPDATE, W_BF16, STOCHASTIC, LAYOUTS, NIBBLE_WORDS, SLICE_N, BK, EPILOGUE_WARPS)
            else:
                if r + 1 < SLICES:  # the next slice's loads, before this slice's update
                    next_offs, next_mask, next_scale_offs = ws_slice_offsets(
                        n_start + (r + 1) * SLICE_N, k_start, N, K, n_blocks, SLICE_N, BK, EPILOGUE_WARPS)
                    next_r_param, next_raws, next_scales = load_tile(
                        W, STATES, SCALES, next_offs, next_mask, next_scale_offs, W_BF16, LAYOUTS, NIBBLE_WORDS,
                        SLICE_N, BK)
                apply_tile(W, STATES, SCALES, HOST, acc, r_param, raws, scales, offs, mask, scale_offs, seed, UPDATE,
                           W_BF16, STOCHASTIC, LAYOUTS, NIBBLE_WORDS, SLICE_N, BK)
                if r + 1 < SLICES:
                    offs, mask, scale_offs = next_offs, next_mask, next_scale_offs
                    r_param, raws, scales = next_r_param, next_raws, next_scales
        ws_stamp_clock(TL, j, 7, TIMELINE)
        ws_stamp_nanoseconds(TL, j, 10, TIMELINE)
        j += 1


@gluon_jit
def ws_mma(X, DY, x_bufs, dy_bufs, ready, empty, acc_smem, acc_ready, acc_empty, T, W, STATES, SCALES, HOST, seed,
           N, K, n_blocks, TL, UPDATE: tl.constexpr, W_BF16: tl.constexpr, STOCHASTIC: tl.constexpr,
           LAYOUTS: tl.constexpr, NIBBLE_WORDS: tl.constexpr, NUM_PROGRAMS: tl.constexpr, GROUP_N: tl.constexpr,
           SLICE_N: tl.constexpr, MMA_SLICES: tl.constexpr, TIMELINE: tl.constexpr, HOST_IN_TABLE: tl.constexpr):
    """The mma partition of `fused_ws`: for each of this program's tiles, dW [BN, BK] by wgmma into acc_smem
    (`ws_accumulate`, `ws_hand_over`); then, while the epilogue updates the tile's other row slices, the last
    MMA_SLICES [SLICE_N, BK] ones here, before the next tile's token loop (worth it where that loop is shorter
    than the epilogue). Timeline: tile j's loop start (slot 0, and the global timer in 9), loop end (2)."""
    HOST, seed = launch_values(HOST, seed, HOST_IN_TABLE)
    BN: tl.constexpr = DY.block_type.shape[1]
    BK: tl.constexpr = X.block_type.shape[1]
    SLICES: tl.constexpr = BN // SLICE_N
    WARPS: tl.constexpr = gl.num_warps()
    first, num_tiles = ws_tiles(N, K, BN, BK)
    it = 0
    j = 0
    for tile in range(first, num_tiles, NUM_PROGRAMS):
        n_start, k_start = ws_tile_start(tile, N, K, BN, BK, GROUP_N)
        ws_stamp_clock(TL, j, 0, TIMELINE)
        ws_stamp_nanoseconds(TL, j, 9, TIMELINE)
        acc, it = ws_accumulate(X, DY, x_bufs, dy_bufs, ready, empty, it, T, n_start, k_start, TL, j,
                                TIMELINE)  # [BN, BK] fp32
        ws_stamp_clock(TL, j, 2, TIMELINE)
        ws_hand_over(acc, acc_smem, acc_ready, acc_empty, j, TL, TIMELINE)
        for r in tl.static_range(SLICES - MMA_SLICES, SLICES):
            b_grad = ws_read_slice(acc_smem, acc_empty, r, SLICES - 1, SLICE_N, WARPS)  # [SLICE_N, BK] fp32
            ws_row_slice(W, STATES, SCALES, HOST, b_grad, n_start + r * SLICE_N, k_start, N, K, n_blocks, seed,
                         UPDATE, W_BF16, STOCHASTIC, LAYOUTS, NIBBLE_WORDS, SLICE_N, BK, WARPS)
        j += 1


@gluon_jit(do_not_specialize=["seed", "T"])
def fused_ws(X, DY, W, STATES, SCALES, HOST, seed, T, N, K, n_blocks, TL,
              UPDATE: tl.constexpr, W_BF16: tl.constexpr, STOCHASTIC: tl.constexpr, LAYOUTS: tl.constexpr,
              NIBBLE_WORDS: tl.constexpr, NUM_PROGRAMS: tl.constexpr, GROUP_N: tl.constexpr, STAGES: tl.constexpr,
              SLICE_N: tl.constexpr, EPILOGUE_WARPS: tl.constexpr, PREFETCH: tl.constexpr, MMA_WARPS: tl.constexpr,
              MMA_REGISTERS: tl.constexpr, MMA_SLICES: tl.constexpr, TIMELINE: tl.constexpr,
              HOST_IN_TABLE: tl.constexpr):
    """`tile_kernels.fused` warp-specialized (Hopper, Gluon): NUM_PROGRAMS persistent programs, each a TMA
    loader warp (`ws_loader`), MMA_WARPS warps of `ws_mma` accumulating one tile's dW = DY[T, N]ᵀ · X[T, K]
    while the EPILOGUE_WARPS of `ws_epilogue` update the tile before it. X, DY: TMA descriptors with blocks
    [BT, BK] and [BT, BN]; the other arguments as for `tile_kernels.fused`. TIMELINE > 0: each partition
    records when it waits and works, per tile, in TL [NUM_PROGRAMS, TIMELINE, TIMELINE_SLOTS] int64
    (`python -m forge_dsl.bench.ws_timeline`); 0: nothing of it is compiled, and TL (any pointer) is never read.
    HOST_IN_TABLE: as for `tile_kernels.fused` (each partition that updates reads the row)."""
    x_bufs, dy_bufs, acc_smem, ready, empty, acc_ready, acc_empty = ws_allocate(X, DY, STAGES, MMA_SLICES)
    gl.warp_specialize([
        (ws_epilogue, (W, STATES, SCALES, HOST, acc_smem, acc_ready, acc_empty, seed, N, K, n_blocks, TL, UPDATE,
                       W_BF16, STOCHASTIC, LAYOUTS, NIBBLE_WORDS, NUM_PROGRAMS, GROUP_N, SLICE_N, EPILOGUE_WARPS,
                       PREFETCH, MMA_SLICES, TIMELINE, HOST_IN_TABLE)),
        (ws_loader, (X, DY, x_bufs, dy_bufs, ready, empty, T, N, K, TL, NUM_PROGRAMS, GROUP_N, TIMELINE)),
        (ws_mma, (X, DY, x_bufs, dy_bufs, ready, empty, acc_smem, acc_ready, acc_empty, T, W, STATES, SCALES, HOST,
                  seed, N, K, n_blocks, TL, UPDATE, W_BF16, STOCHASTIC, LAYOUTS, NIBBLE_WORDS, NUM_PROGRAMS, GROUP_N,
                  SLICE_N, MMA_SLICES, TIMELINE, HOST_IN_TABLE)),
    ], [1, MMA_WARPS], [24, MMA_REGISTERS])


# ---------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------


def descriptor(t, block_shape: list[int]):
    """A Gluon TMA descriptor of the 2-D bf16 activation `t` [T, C] with blocks `block_shape` [BT, BC]
    (`checks.tma_compatible(t)` must hold); the shared-memory layout is the 128-byte swizzle wgmma reads."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block_shape, shared_layout(tuple(block_shape)))


@functools.lru_cache(maxsize=None)
def shared_layout(block_shape: tuple[int, ...]):
    """The shared-memory layout of a bf16 TMA block of `block_shape` (the 128-byte swizzle wgmma reads)."""
    return gl.NVMMASharedLayout.get_default_for(list(block_shape), gl.bfloat16)


@functools.lru_cache(maxsize=None)
def sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA device: the persistent kernel's number of programs."""
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count
