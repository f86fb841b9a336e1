"""Experiment: a warp-specialized fused AdamW kernel in Gluon, so the epilogue overlaps the token loop.

The Triton fused kernel runs its token loop and its epilogue in the same warps, one after the
other (docs/PERF.md v4a: fused ≈ loop + epilogue, 20–40 % of the shorter part hidden). Here each
SM runs one persistent program with three partitions:

  loader   (1 warp)      TMA copies of DY [BT, BN] and X [BT, BK] blocks into a ring of STAGES buffers
  mma      (4 warps)     wgmma: acc [BN, BK] fp32 += DY blockᵀ · X block; at the end of a tile it
                         stores acc into shared memory (64 KiB) and moves on to the next tile
  epilogue (the kernel's num_warps, the default partition)
                         reads the stored tile in [SLICE_N, BK] row slices and applies
                         generated/adamw.py's `_load_v0` / `_apply_v0` (bf16 W, bf16 state,
                         stochastic rounding) while the mma partition accumulates the next tile

With PREFETCH the epilogue issues the W / state loads of its next slice (and of the next tile's first
slice, before waiting for that tile's dW) before it updates the current one.

    python bench/gluon_ws.py --compile                       (sm_90 offline: registers, shared memory)
    python bench/gluon_ws.py --case 4096x4096 --tokens 512,2048,8192 [--json FILE]   (on a GPU)

Scratch weights and state only; bf16 activations, weights and state.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from forge_dsl.generated.adamw import _apply_v0, _load_v0
from forge_dsl.kernels.gluon_lib import _tma_load
from forge_dsl.kernels.launch import mix_seed
from forge_dsl.kernels.triton_lib import grouped_tile

# (epilogue warps, STAGES, SLICE_N, PREFETCH, mma warps, mma registers per thread, nearest rounding,
#  no dW read: the epilogue updates from zeros instead of acc_smem)
WS_CONFIGS = {
    "e8 s4 slice32 m8": (8, 4, 32, False, 8, 104, False, False),
    "e8 s4 slice32 m8 prefetch": (8, 4, 32, True, 8, 104, False, False),
    "e8 s4 slice32 m8 nearest": (8, 4, 32, False, 8, 104, True, False),
    "e8 s4 slice32 m8 no-dW-read": (8, 4, 32, False, 8, 104, False, True),
    "e8 s4 slice16 m8 prefetch": (8, 4, 16, True, 8, 104, False, False),
    "e4 s4 slice32 m8 prefetch": (4, 4, 32, True, 8, 120, False, False),
}
BLOCK_T, BLOCK_N, BLOCK_K, GROUP_N = 64, 128, 128, 8


@gluon.jit
def _tile_start(tile, N, K, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_N: gl.constexpr):
    pid_n, pid_k = grouped_tile(tile, N, K, BLOCK_N, BLOCK_K, GROUP_N)
    return pid_n * BLOCK_N, pid_k * BLOCK_K


@gluon.jit
def _loader(x_desc, dy_desc, x_bufs, dy_bufs, ready, empty, acc_smem, acc_ready, acc_empty, T, N, K,
            NUM_PROGRAMS: gl.constexpr, GROUP_N: gl.constexpr):
    """Worker: TMA copies of each tile's token blocks into the ring."""
    BT: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BN: gl.constexpr = dy_desc.block_type.shape[1]
    STAGES: gl.constexpr = x_bufs.type.shape[0]
    num_tiles = gl.cdiv(N, BN) * gl.cdiv(K, BK)
    it = 0
    for tile in range(gl.program_id(0), num_tiles, NUM_PROGRAMS):
        n_start, k_start = _tile_start(tile, N, K, BN, BK, GROUP_N)
        for t0 in range(0, T, BT):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), x_desc.block_type.nbytes + dy_desc.block_type.nbytes)
            _tma_load(x_desc, [t0, k_start], ready.index(s), x_bufs.index(s))
            _tma_load(dy_desc, [t0, n_start], ready.index(s), dy_bufs.index(s))
            it += 1


@gluon.jit
def _mma(x_desc, dy_desc, x_bufs, dy_bufs, ready, empty, acc_smem, acc_ready, acc_empty, T, N, K,
         NUM_PROGRAMS: gl.constexpr, GROUP_N: gl.constexpr):
    """Worker (4 warps): acc [BN, BK] = DYᵀ·X over all tokens with wgmma, then hand it to the epilogue."""
    BT: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BN: gl.constexpr = dy_desc.block_type.shape[1]
    STAGES: gl.constexpr = x_bufs.type.shape[0]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                     instr_shape=[16, BK, 16])
    num_tiles = gl.cdiv(N, BN) * gl.cdiv(K, BK)
    it = 0
    j = 0
    for tile in range(gl.program_id(0), num_tiles, NUM_PROGRAMS):
        acc = gl.zeros([BN, BK], gl.float32, layout)
        for t0 in range(0, T, BT):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            acc = warpgroup_mma(dy_bufs.index(s).permute((1, 0)), x_bufs.index(s), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            # the wgmma before this one has finished reading its stage
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=t0 > 0)
            it += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=T > 0)
        mbarrier.wait(acc_empty, (j & 1) ^ 1)
        acc_smem.store(acc)
        mbarrier.arrive(acc_ready)
        j += 1


@gluon.jit
def _slice_offsets(n_start, k_start, N, K, SLICE_N: gl.constexpr, BK: gl.constexpr, layout: gl.constexpr):
    rows = n_start + gl.arange(0, SLICE_N, layout=gl.SliceLayout(1, layout))
    cols = k_start + gl.arange(0, BK, layout=gl.SliceLayout(0, layout))
    offs = rows.to(gl.int64)[:, None] * K + cols.to(gl.int64)[None, :]
    mask = (rows[:, None] < N) & (cols[None, :] < K)
    return offs, mask, rows


@gluon.jit
def _epilogue(W, S_m, S_v, h0, h1, h2, h3, h4, h5, h6, seed, acc_smem, acc_ready, acc_empty, N, K,
              NUM_PROGRAMS: gl.constexpr, GROUP_N: gl.constexpr, SLICE_N: gl.constexpr, PREFETCH: gl.constexpr,
              EPI_WARPS: gl.constexpr, NEAREST: gl.constexpr, NO_ACC: gl.constexpr):
    """Default partition: the AdamW update of each tile, a [SLICE_N, BK] row slice at a time."""
    BN: gl.constexpr = acc_smem.type.shape[0]
    BK: gl.constexpr = acc_smem.type.shape[1]
    NS: gl.constexpr = BN // SLICE_N
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [EPI_WARPS, 1], [1, 0])
    num_tiles = gl.cdiv(N, BN) * gl.cdiv(K, BK)
    j = 0
    for tile in range(gl.program_id(0), num_tiles, NUM_PROGRAMS):
        n_start, k_start = _tile_start(tile, N, K, BN, BK, GROUP_N)
        offs, mask, rows = _slice_offsets(n_start, k_start, N, K, SLICE_N, BK, layout)
        if PREFETCH:
            r_w, r_m, q_m, r_v, q_v = _load_v0(W, S_m, S_m, S_v, S_v, offs, mask, rows, k_start, 1, True, 1, 1,
                                               SLICE_N, BK)
        mbarrier.wait(acc_ready, j & 1)
        for r in gl.static_range(NS):
            if NO_ACC:
                g = gl.zeros([SLICE_N, BK], gl.float32, layout)
            else:
                g = acc_smem.slice(r * SLICE_N, SLICE_N, dim=0).load(layout)  # [SLICE_N, BK] fp32
            if r == NS - 1:
                mbarrier.arrive(acc_empty)  # the whole tile is read: the mma partition may store the next
            if not PREFETCH:
                r_w, r_m, q_m, r_v, q_v = _load_v0(W, S_m, S_m, S_v, S_v, offs, mask, rows, k_start, 1, True,
                                                   1, 1, SLICE_N, BK)
            c_offs, c_mask, c_rows = offs, mask, rows
            c_w, c_m, cq_m, c_v, cq_v = r_w, r_m, q_m, r_v, q_v
            if r + 1 < NS:
                offs, mask, rows = _slice_offsets(n_start + (r + 1) * SLICE_N, k_start, N, K, SLICE_N, BK, layout)
                if PREFETCH:
                    r_w, r_m, q_m, r_v, q_v = _load_v0(W, S_m, S_m, S_v, S_v, offs, mask, rows, k_start, 1, True,
                                                       1, 1, SLICE_N, BK)
            _apply_v0(W, S_m, S_m, S_v, S_v, h0, h1, h2, h3, h4, h5, h6, g, c_w, c_m, cq_m, c_v, cq_v, c_offs,
                      c_mask, c_rows, k_start, 1, seed, True, not NEAREST, 1, 1, SLICE_N, BK)
        j += 1


@gluon.jit(do_not_specialize=["seed"])
def adamw_gluon_ws(x_desc, dy_desc, W, S_m, S_v, h0, h1, h2, h3, h4, h5, h6, seed, T, N, K,
                   NUM_PROGRAMS: gl.constexpr, GROUP_N: gl.constexpr, STAGES: gl.constexpr,
                   SLICE_N: gl.constexpr, PREFETCH: gl.constexpr, MMA_WARPS: gl.constexpr,
                   MMA_REGS: gl.constexpr, NEAREST: gl.constexpr, NO_ACC: gl.constexpr, num_warps: gl.constexpr):
    """W [N, K] (int16 view of bf16) -= AdamW(dW = DY[T, N]ᵀ · X[T, K]); bf16 state S_m, S_v (int16 views)."""
    BT: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BN: gl.constexpr = dy_desc.block_type.shape[1]
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BT, BK], x_desc.layout)
    dy_bufs = gl.allocate_shared_memory(dy_desc.dtype, [STAGES, BT, BN], dy_desc.layout)
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
    mbarrier.init(acc_empty, count=1)
    worker_args = (x_desc, dy_desc, x_bufs, dy_bufs, ready, empty, acc_smem, acc_ready, acc_empty, T, N, K,
                   NUM_PROGRAMS, GROUP_N)
    gl.warp_specialize([
        (_epilogue, (W, S_m, S_v, h0, h1, h2, h3, h4, h5, h6, seed, acc_smem, acc_ready, acc_empty, N, K,
                     NUM_PROGRAMS, GROUP_N, SLICE_N, PREFETCH, num_warps, NEAREST, NO_ACC)),
        (_loader, worker_args),
        (_mma, worker_args),
    ], [1, MMA_WARPS], [24, MMA_REGS])


def _maxnreg(epi_warps: int, mma_warps: int) -> int:
    """Registers per thread the launch may ask for: 64 K registers over every warp (a loader warp group of 4)."""
    return min(255, 65536 // ((epi_warps + 4 + mma_warps) * 32)) // 8 * 8


def launch(x, dy, w, m, v, exports, seed, cfg, programs: int = 0, tokens=None) -> None:
    """One fused AdamW step of the experiment kernel on bf16 x [T, K], dy [T, N], w [N, K], m, v [N, K]."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    epi_warps, stages, slice_n, prefetch, mma_warps, mma_regs, nearest, no_acc = cfg
    T, K = x.shape
    T = T if tokens is None else tokens
    N = dy.shape[1]
    lay_x = gl.NVMMASharedLayout.get_default_for([BLOCK_T, BLOCK_K], gl.bfloat16)
    lay_dy = gl.NVMMASharedLayout.get_default_for([BLOCK_T, BLOCK_N], gl.bfloat16)
    x_desc = TensorDescriptor.from_tensor(x, [BLOCK_T, BLOCK_K], lay_x)
    dy_desc = TensorDescriptor.from_tensor(dy, [BLOCK_T, BLOCK_N], lay_dy)
    n_tiles = triton.cdiv(N, BLOCK_N) * triton.cdiv(K, BLOCK_K)
    programs = min(programs or torch.cuda.get_device_properties(w.device).multi_processor_count, n_tiles)
    adamw_gluon_ws[(programs,)](
        x_desc, dy_desc, w.view(torch.int16), m.view(torch.int16), v.view(torch.int16), *exports, seed, T, N, K,
        NUM_PROGRAMS=programs, GROUP_N=GROUP_N, STAGES=stages, SLICE_N=slice_n, PREFETCH=prefetch,
        MMA_WARPS=mma_warps, MMA_REGS=mma_regs, NEAREST=nearest, NO_ACC=no_acc, num_warps=epi_warps, maxnreg=_maxnreg(epi_warps, mma_warps))


def compile_offline(cfg) -> str:
    """Compile for sm_90 without a GPU; registers, spills and shared memory as ptxas reports them."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from forge_dsl.kernels.sm90 import _resources

    epi_warps, stages, slice_n, prefetch, mma_warps, mma_regs, nearest, no_acc = cfg
    lay_x = gl.NVMMASharedLayout.get_default_for([BLOCK_T, BLOCK_K], gl.bfloat16)
    lay_dy = gl.NVMMASharedLayout.get_default_for([BLOCK_T, BLOCK_N], gl.bfloat16)
    signature = {"x_desc": f"tensordesc<bf16[{BLOCK_T}, {BLOCK_K}],{lay_x!r}>",
                 "dy_desc": f"tensordesc<bf16[{BLOCK_T}, {BLOCK_N}],{lay_dy!r}>",
                 "W": "*i16", "S_m": "*i16", "S_v": "*i16", **{f"h{i}": "fp32" for i in range(7)},
                 "seed": "i32", "T": "i32", "N": "i32", "K": "i32"}
    constexprs = {"NUM_PROGRAMS": 132, "GROUP_N": GROUP_N, "STAGES": stages, "SLICE_N": slice_n,
                  "PREFETCH": prefetch, "MMA_WARPS": mma_warps, "MMA_REGS": mma_regs, "NEAREST": nearest, "NO_ACC": no_acc, "num_warps": epi_warps}
    for name in constexprs:
        signature[name] = "constexpr"
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(adamw_gluon_ws.arg_names)
             if a in ("W", "S_m", "S_v", "N", "K")}
    src = GluonASTSource(adamw_gluon_ws, signature, constexprs, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": epi_warps, "maxnreg": _maxnreg(epi_warps, mma_warps)})
    import triton as _triton
    return str(_resources(kernel, _triton)), kernel


def run_case(N: int, K: int, T: int, rows: list) -> None:
    import forge_dsl
    from forge_dsl import kernels
    from forge_dsl.bench import kernel as bench_kernel
    from forge_dsl.config import resolve_hypers
    from forge_dsl.generated import adamw as adamw_module

    from anatomy import graph_ms  # bench/anatomy.py

    spec = forge_dsl.load_spec("adamw")
    shape = bench_kernel.Shape(f"{N}x{K}", N, K)
    cuda = torch.device("cuda")
    x, dy = bench_kernel.make_inputs(T, shape, cuda)
    w = bench_kernel.scratch_weight(shape, cuda)
    state = forge_dsl.init_state(spec, w, layout="bf16")
    # a state that is not zero, so the check below sees every term of the update
    state["exp_avg"].copy_(torch.randn_like(w, dtype=torch.float32) * 1e-3)
    state["exp_avg_sq"].copy_(torch.rand_like(w, dtype=torch.float32) * 1e-6)
    exports, _ = adamw_module.host_v0(resolve_hypers(spec, {"lr": 1e-4}).hypers, 3, {})
    dw = torch.empty(N, K, device="cuda", dtype=torch.bfloat16)

    def add(what, ms, **extra):
        rows.append({"N": N, "K": K, "T": T, "what": what, "ms": ms, **extra})
        print(json.dumps(rows[-1]), flush=True)

    # correctness first: one step from the same start against the Triton fused kernel (same seed)
    ref_w, ref_s = w.clone(), {k: t.clone() for k, t in state.items()}
    from forge_dsl.kernels.launch import fused_config
    triton_cfg = fused_config(T, N, K, cuda, hopper=False)  # the Triton kernel's tiles
    kernels.fused_linear_step(spec, x, dy, ref_w, ref_s, step=3, lr=1e-4, seed=77, config=triton_cfg)
    for name, cfg in WS_CONFIGS.items():
        w2, m2, v2 = w.clone(), state["exp_avg"].clone(), state["exp_avg_sq"].clone()
        try:
            launch(x, dy, w2, m2, v2, exports, mix_seed(77, 3), cfg)
            torch.cuda.synchronize()
        except Exception as err:
            add(f"{name} | check", float("nan"), error=f"{type(err).__name__}: {str(err)[:400]}")
            continue
        check = {}
        for what, got, ref in (("w", w2, ref_w), ("m", m2, ref_s["exp_avg"]), ("v", v2, ref_s["exp_avg_sq"])):
            diff = (got.float() - ref.float()).abs()
            check[what] = {"bits_equal": float((got.view(torch.int16) == ref.view(torch.int16)).float().mean()),
                           "max_abs": float(diff.max()), "ref_max_abs": float(ref.float().abs().max())}
        add(f"{name} | check", float("nan"), check=check)

    add("cuBLAS dW", graph_ms(lambda: torch.matmul(dy.t(), x, out=dw)))
    p = torch.nn.Parameter(w.clone())
    p.grad = dw
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True, capturable=True)
    add("torch pair", graph_ms(lambda: (torch.matmul(dy.t(), x, out=dw), opt.step())))
    del p, opt
    add("triton fused (default)", graph_ms(lambda: kernels.fused_linear_step(spec, x, dy, w, state, step=3, lr=1e-4,
                                                                           config=triton_cfg)))
    add("triton epilogue (default)",
        graph_ms(lambda: kernels.fused_linear_step(spec, x[:0], dy[:0], w, state, step=3, lr=1e-4,
                                                   config=triton_cfg)))
    add("generated ws (default)", graph_ms(lambda: kernels.fused_linear_step(spec, x, dy, w, state, step=3,
                                                                            lr=1e-4)))
    m, v = state["exp_avg"], state["exp_avg_sq"]
    for name, cfg in WS_CONFIGS.items():
        add(name, graph_ms(lambda: launch(x, dy, w, m, v, exports, 1234, cfg)))
        add(f"{name} | epilogue", graph_ms(lambda: launch(x, dy, w, m, v, exports, 1234, cfg, tokens=0)))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile", action="store_true", help="compile every config for sm_90 offline and stop")
    ap.add_argument("--case", action="append", help="NxK (repeatable; default 4096x4096)")
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.compile:
        for name, cfg in WS_CONFIGS.items():
            print(f"{name:<36} {compile_offline(cfg)[0]}", flush=True)
        return
    from forge_dsl.bench.common import device_name, git_commit

    data = {"command": shlex.join(["python", "bench/gluon_ws.py", *(argv if argv is not None else sys.argv[1:])]),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "device": device_name(torch.device("cuda")), "torch": torch.__version__, "triton": triton.__version__,
            "git_commit": git_commit(), "timing": "CUDA graph of 20 calls, median of 10 replays, ms per call",
            "rows": []}
    for case in args.case or ["4096x4096"]:
        N, K = (int(s) for s in case.split("x"))
        for T in (int(t) for t in args.tokens.split(",")):
            run_case(N, K, T, data["rows"])
            torch.cuda.empty_cache()
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(data, f, indent=1)


if __name__ == "__main__":
    main()
