"""Who waits for whom in the warp-specialized fused kernel: a per-tile timeline of each partition (docs/PERF.md, v12e).

The kernel below is `gluon_lib.fused_ws` with AdamW's update (no flags) and `%clock64` stamps at each
barrier wait of its three partitions, written to a buffer TL [programs, tiles, SLOTS] int64. A program's
partitions share one SM, so its stamps share one clock. Per tile j of a program:

  mma       0 loop start, 1 cycles waiting for ring buffers (summed over the token blocks), 2 loop end,
            3 acc_smem free (the epilogue has read tile j - 1), 4 tile j handed over (stored, signalled)
  epilogue  5 before waiting for tile j (the first slice's loads already out), 6 tile j ready, 7 tile j done
  loader    8 cycles waiting for free ring buffers during tile j (summed)
  clocks    9 `%globaltimer` (ns) beside slot 0, 10 beside slot 7: cycles over nanoseconds give the SM clock

    python bench/ws_timeline.py --shapes 4096x4096,14336x4096 --tokens 512,2048 [--config 64,128,128,8,5,split=4,ws=8]

Prints, per case, the mean over programs and over tiles after each program's first: the tile period and
where it goes, in µs at the SM clock measured by the same run (cycles over elapsed time of a timed call).
Checks first that the instrumented kernel writes the same bits as `fused_linear_step` with the same config.
Scratch tensors only; needs a Hopper GPU with Gluon (Triton >= 3.6).
"""

from __future__ import annotations

import argparse

import torch
import triton.language as tl

import forge_dsl
from forge_dsl.kernels import TileConfig
from forge_dsl.kernels.gluon_lib import (
    _tma_load, descriptor, gl, gluon_jit, mbarrier, sm_count, warpgroup_mma, warpgroup_mma_wait, mma_layout,
    ws_allocate, ws_read_slice, ws_row_slice, ws_slice_offsets, ws_tile_start, ws_tiles,
)
from forge_dsl.kernels.tile_kernels import apply_tile, load_tile
from forge_dsl.kernels.launch import (
    _hopper_with_gluon, _prepare_state, _variant, fused_config, fused_linear_step, mix_seed, rounding_code, triton_cdiv,
)
from forge_dsl.layouts import n_blocks

SLOTS = tl.constexpr(16)  # int64 stamps per (program, tile); 11 used


@gluon_jit
def _clock():
    return gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon_jit
def _nanoseconds():
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon_jit
def _put(TL, j, slot: tl.constexpr, value, MAX_TILES: tl.constexpr):
    if j < MAX_TILES:
        gl.store(TL + (gl.program_id(0) * MAX_TILES + j) * SLOTS + slot, value)


@gluon_jit
def _loader_tl(X, DY, x_bufs, dy_bufs, ready, empty, T, N, K, TL, NUM_PROGRAMS: tl.constexpr, GROUP_N: tl.constexpr,
               MAX_TILES: tl.constexpr):
    """`gluon_lib.ws_loader`, with its waits for free buffers summed per tile (slot 8)."""
    BT: tl.constexpr = X.block_type.shape[0]
    BK: tl.constexpr = X.block_type.shape[1]
    BN: tl.constexpr = DY.block_type.shape[1]
    STAGES: tl.constexpr = x_bufs.type.shape[0]
    first, num_tiles = ws_tiles(N, K, BN, BK)
    it = 0
    j = 0
    for tile in range(first, num_tiles, NUM_PROGRAMS):
        n_start, k_start = ws_tile_start(tile, N, K, BN, BK, GROUP_N)
        waited = _clock() * 0
        for t0 in range(0, T, BT):
            s = it % STAGES
            c0 = _clock()
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            waited += _clock() - c0
            mbarrier.expect(ready.index(s), X.block_type.nbytes + DY.block_type.nbytes)
            _tma_load(X, [t0, k_start], ready.index(s), x_bufs.index(s))
            _tma_load(DY, [t0, n_start], ready.index(s), dy_bufs.index(s))
            it += 1
        _put(TL, j, 8, waited, MAX_TILES)
        j += 1


@gluon_jit
def _accumulate_tl(X, DY, x_bufs, dy_bufs, ready, empty, it, T, n_start, k_start, TL, j, MAX_TILES: tl.constexpr):
    """`gluon_lib.ws_accumulate`, with its waits for filled buffers summed (slot 1)."""
    BT: tl.constexpr = X.block_type.shape[0]
    BK: tl.constexpr = X.block_type.shape[1]
    BN: tl.constexpr = DY.block_type.shape[1]
    STAGES: tl.constexpr = x_bufs.type.shape[0]
    acc = gl.zeros([BN, BK], gl.float32, mma_layout(gl.num_warps(), BK))
    waited = _clock() * 0
    for t0 in range(0, T, BT):
        s = it % STAGES
        c0 = _clock()
        mbarrier.wait(ready.index(s), (it // STAGES) & 1)
        waited += _clock() - c0
        acc = warpgroup_mma(dy_bufs.index(s).permute((1, 0)), x_bufs.index(s), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=t0 > 0)
        it += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=T > 0)
    _put(TL, j, 1, waited, MAX_TILES)
    return acc, it


@gluon_jit
def _mma_tl(X, DY, x_bufs, dy_bufs, ready, empty, acc_smem, acc_ready, acc_empty, T, W, STATES, SCALES, HOST, seed,
            N, K, n_blocks, TL, UPDATE: tl.constexpr, W_BF16: tl.constexpr, STOCHASTIC: tl.constexpr,
            LAYOUTS: tl.constexpr, NUM_PROGRAMS: tl.constexpr, GROUP_N: tl.constexpr, SLICE_N: tl.constexpr,
            MMA_SLICES: tl.constexpr, MAX_TILES: tl.constexpr):
    """`gluon_lib.ws_mma` with stamps (slots 0-4)."""
    BN: tl.constexpr = DY.block_type.shape[1]
    BK: tl.constexpr = X.block_type.shape[1]
    SLICES: tl.constexpr = BN // SLICE_N
    WARPS: tl.constexpr = gl.num_warps()
    first, num_tiles = ws_tiles(N, K, BN, BK)
    it = 0
    j = 0
    for tile in range(first, num_tiles, NUM_PROGRAMS):
        n_start, k_start = ws_tile_start(tile, N, K, BN, BK, GROUP_N)
        _put(TL, j, 0, _clock(), MAX_TILES)
        _put(TL, j, 9, _nanoseconds(), MAX_TILES)
        acc, it = _accumulate_tl(X, DY, x_bufs, dy_bufs, ready, empty, it, T, n_start, k_start, TL, j, MAX_TILES)
        _put(TL, j, 2, _clock(), MAX_TILES)
        mbarrier.wait(acc_empty, (j & 1) ^ 1)  # gluon_lib.ws_hand_over, stamped
        _put(TL, j, 3, _clock(), MAX_TILES)
        acc_smem.store(acc)
        mbarrier.arrive(acc_ready)
        _put(TL, j, 4, _clock(), MAX_TILES)
        for r in tl.static_range(SLICES - MMA_SLICES, SLICES):
            b_grad = ws_read_slice(acc_smem, acc_empty, r, SLICES - 1, SLICE_N, WARPS)
            ws_row_slice(W, STATES, SCALES, HOST, b_grad, n_start + r * SLICE_N, k_start, N, K, n_blocks, seed,
                         UPDATE, W_BF16, STOCHASTIC, LAYOUTS, SLICE_N, BK, WARPS)
        j += 1


@gluon_jit
def _epilogue_tl(W, STATES, SCALES, HOST, acc_smem, acc_ready, acc_empty, seed, N, K, n_blocks, TL,
                 UPDATE: tl.constexpr, W_BF16: tl.constexpr, STOCHASTIC: tl.constexpr, LAYOUTS: tl.constexpr,
                 NUM_PROGRAMS: tl.constexpr, GROUP_N: tl.constexpr, SLICE_N: tl.constexpr,
                 EPILOGUE_WARPS: tl.constexpr, MMA_SLICES: tl.constexpr, MAX_TILES: tl.constexpr):
    """`gluon_lib.ws_epilogue` (its prefetching form, the default with bf16 state) with stamps (slots 5-7)."""
    BN: tl.constexpr = acc_smem.type.shape[0]
    BK: tl.constexpr = acc_smem.type.shape[1]
    SLICES: tl.constexpr = BN // SLICE_N - MMA_SLICES
    first, num_tiles = ws_tiles(N, K, BN, BK)
    j = 0
    for tile in range(first, num_tiles, NUM_PROGRAMS):
        n_start, k_start = ws_tile_start(tile, N, K, BN, BK, GROUP_N)
        offs, mask, scale_offs = ws_slice_offsets(n_start, k_start, N, K, n_blocks, SLICE_N, BK, EPILOGUE_WARPS)
        r_param, raws, scales = load_tile(W, STATES, SCALES, offs, mask, scale_offs, W_BF16, LAYOUTS, SLICE_N, BK)
        _put(TL, j, 5, _clock(), MAX_TILES)
        mbarrier.wait(acc_ready, j & 1)
        _put(TL, j, 6, _clock(), MAX_TILES)
        for r in tl.static_range(SLICES):
            acc = ws_read_slice(acc_smem, acc_empty, r, SLICES - 1, SLICE_N, EPILOGUE_WARPS)
            if r + 1 < SLICES:
                next_offs, next_mask, next_scale_offs = ws_slice_offsets(
                    n_start + (r + 1) * SLICE_N, k_start, N, K, n_blocks, SLICE_N, BK, EPILOGUE_WARPS)
                next_r_param, next_raws, next_scales = load_tile(
                    W, STATES, SCALES, next_offs, next_mask, next_scale_offs, W_BF16, LAYOUTS, SLICE_N, BK)
            apply_tile(W, STATES, SCALES, HOST, acc, r_param, raws, scales, offs, mask, scale_offs, seed, UPDATE,
                       W_BF16, STOCHASTIC, LAYOUTS, SLICE_N, BK)
            if r + 1 < SLICES:
                offs, mask, scale_offs = next_offs, next_mask, next_scale_offs
                r_param, raws, scales = next_r_param, next_raws, next_scales
        _put(TL, j, 7, _clock(), MAX_TILES)
        _put(TL, j, 10, _nanoseconds(), MAX_TILES)
        j += 1


@gluon_jit(do_not_specialize=["seed", "T"])
def fused_tl(X, DY, W, STATES, SCALES, HOST, seed, T, N, K, n_blocks, TL, UPDATE: tl.constexpr,
             W_BF16: tl.constexpr, STOCHASTIC: tl.constexpr, LAYOUTS: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
             GROUP_N: tl.constexpr, STAGES: tl.constexpr, SLICE_N: tl.constexpr, EPILOGUE_WARPS: tl.constexpr,
             MMA_WARPS: tl.constexpr, MMA_REGISTERS: tl.constexpr, MMA_SLICES: tl.constexpr,
             MAX_TILES: tl.constexpr):
    """`gluon_lib.fused_ws` with the three stamped partitions."""
    x_bufs, dy_bufs, acc_smem, ready, empty, acc_ready, acc_empty = ws_allocate(X, DY, STAGES, MMA_SLICES)
    gl.warp_specialize([
        (_epilogue_tl, (W, STATES, SCALES, HOST, acc_smem, acc_ready, acc_empty, seed, N, K, n_blocks, TL, UPDATE,
                        W_BF16, STOCHASTIC, LAYOUTS, NUM_PROGRAMS, GROUP_N, SLICE_N, EPILOGUE_WARPS, MMA_SLICES,
                        MAX_TILES)),
        (_loader_tl, (X, DY, x_bufs, dy_bufs, ready, empty, T, N, K, TL, NUM_PROGRAMS, GROUP_N, MAX_TILES)),
        (_mma_tl, (X, DY, x_bufs, dy_bufs, ready, empty, acc_smem, acc_ready, acc_empty, T, W, STATES, SCALES, HOST,
                   seed, N, K, n_blocks, TL, UPDATE, W_BF16, STOCHASTIC, LAYOUTS, NUM_PROGRAMS, GROUP_N, SLICE_N,
                   MMA_SLICES, MAX_TILES)),
    ], [1, MMA_WARPS], [24, MMA_REGISTERS])


def launch(x, dy, weight, state, cfg: TileConfig, *, step: int, seed: int, timeline: torch.Tensor, **hypers):
    """One call of `fused_tl`, with the arguments `launch._launch_warp_specialized` gives `gluon_lib.fused_ws`.

    x [T, K], dy [T, N] bf16; weight [N, K] bf16; state: AdamW's, bf16 layout; timeline [programs, tiles, SLOTS]
    int64, filled in place."""
    T, K = x.shape
    N = dy.shape[1]
    spec = forge_dsl.load_spec("adamw")
    update, names, exports, _ = _variant(spec, hypers, step, state)
    states = _prepare_state(spec, names, state, weight)
    programs, max_tiles = timeline.shape[:2]
    fused_tl[(programs,)](
        descriptor(x, [cfg.block_t, cfg.block_k]), descriptor(dy, [cfg.block_t, cfg.block_n]), weight.view(torch.int16),
        states.storage, states.scales, exports, mix_seed(seed, step), T, N, K, n_blocks(K), timeline,
        UPDATE=update, W_BF16=True, STOCHASTIC=rounding_code("stochastic", K), LAYOUTS=states.layouts,
        NUM_PROGRAMS=programs, GROUP_N=cfg.group_n, STAGES=cfg.num_stages, SLICE_N=cfg.block_n // cfg.epilogue_split,
        EPILOGUE_WARPS=cfg.num_warps, MMA_WARPS=cfg.mma_warps, MMA_REGISTERS=cfg.mma_registers,
        MMA_SLICES=cfg.mma_slices, MAX_TILES=max_tiles, num_warps=cfg.num_warps, maxnreg=cfg.launch_maxnreg,
    )


def summarize(tl_cycles: torch.Tensor, tiles_per_program: list[int], ghz: float) -> dict[str, float]:
    """Mean µs per tile, over programs and their tiles after the first, of the period and its parts.

    tl_cycles [programs, tiles, SLOTS] int64 as `fused_tl` wrote it (see the module docstring); a program's
    tiles past tiles_per_program[p] are unused. "mma after hand-over" (the MMA warps' own slices, until the
    next tile's loop starts) needs a next tile, so it leaves out each program's last."""
    parts: dict[str, list[float]] = {}

    def add(name: str, cycles) -> None:
        parts.setdefault(name, []).append(float(cycles))

    for p, n in enumerate(tiles_per_program):
        t = tl_cycles[p, :n].double()
        for j in range(1, n):
            add("period", t[j, 0] - t[j - 1, 0])
            add("loop", t[j, 2] - t[j, 0])
            add("loop: ring waits", t[j, 1])
            add("mma waits for acc_smem", t[j, 3] - t[j, 2])
            add("hand-over store", t[j, 4] - t[j, 3])
            if j + 1 < n:
                add("mma after hand-over", t[j + 1, 0] - t[j, 4])
            add("epilogue waits for tile", t[j, 6] - t[j, 5])
            add("epilogue busy", t[j, 7] - t[j, 6])
            add("loader ring-full waits", t[j, 8])
    return {name: sum(v) / len(v) / (ghz * 1e3) for name, v in parts.items()}


def _time(call, calls: int = 5) -> float:
    """Mean ms of `calls` calls queued behind a GPU sleep, so the host's launch time is not in it."""
    call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(5_000_000)  # a few ms of GPU time while the host queues the calls
    start.record()
    for _ in range(calls):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="4096x4096,14336x4096", help="NxK,... (default: q/o and gate/up)")
    ap.add_argument("--tokens", default="512,2048", help="T,... (default: 512,2048)")
    ap.add_argument("--config", help="tile config (default: fused_config's)")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not _hopper_with_gluon(torch.device("cuda")):
        raise SystemExit("bench/ws_timeline.py times the warp-specialized kernel: it needs a Hopper GPU (sm_90) "
                         "and a Triton with Gluon (>= 3.6)")
    dev = torch.device("cuda")
    programs_max = sm_count(dev)
    for shape in args.shapes.split(","):
        N, K = (int(v) for v in shape.lower().split("x"))
        for T in (int(v) for v in args.tokens.split(",")):
            cfg = TileConfig.parse(args.config) if args.config else fused_config(T, N, K, dev)
            g = torch.Generator(device=dev).manual_seed(0)
            x = torch.randn(T, K, device=dev, generator=g).bfloat16()
            dy = (torch.randn(T, N, device=dev, generator=g) * 1e-3).bfloat16()
            w = (torch.randn(N, K, device=dev, generator=g) * 0.02).bfloat16()
            state = forge_dsl.init_state("adamw", w, layout="bf16")
            tiles = triton_cdiv(N, cfg.block_n) * triton_cdiv(K, cfg.block_k)
            programs = min(programs_max, tiles)
            per_program = [len(range(p, tiles, programs)) for p in range(programs)]
            timeline = torch.zeros(programs, max(per_program), SLOTS, dtype=torch.int64, device=dev)
            # the same bits as the product kernel, from the same state
            w2, state2 = w.clone(), {k: v.clone() for k, v in state.items()}
            launch(x, dy, w, state, cfg, step=1, seed=5, timeline=timeline, lr=1e-3)
            fused_linear_step("adamw", x, dy, w2, state2, step=1, seed=5, config=cfg, lr=1e-3)
            same = torch.equal(w.view(torch.int16), w2.view(torch.int16)) and all(
                torch.equal(state[k].view(torch.int16), state2[k].view(torch.int16)) for k in state)
            # timed calls; the timeline left is the last call's
            ms = _time(lambda: launch(x, dy, w, state, cfg, step=3, seed=5, timeline=timeline, lr=1e-3))
            ms_product = _time(lambda: fused_linear_step("adamw", x, dy, w2, state2, step=3, seed=5, config=cfg,
                                                         lr=1e-3))
            cyc = timeline.cpu()
            ghz = sum(float(cyc[p, n - 1, 7] - cyc[p, 0, 0]) / float(cyc[p, n - 1, 10] - cyc[p, 0, 9])
                      for p, n in enumerate(per_program)) / programs
            parts = summarize(cyc, per_program, ghz)
            print(f"\nW {N}×{K}, T = {T}: {ms * 1e3:.1f} µs (the product kernel: {ms_product * 1e3:.1f}), "
                  f"{programs} programs × up to {max(per_program)} tiles, SM clock {ghz:.2f} GHz, "
                  f"same bits as fused_linear_step: {same}")
            for k, v in parts.items():
                print(f"  {k:>26}: {v:7.2f} µs")


if __name__ == "__main__":
    main()
