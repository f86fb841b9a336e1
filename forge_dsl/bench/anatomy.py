"""Where the fused kernel's time goes: its parts timed alone, side by side in one run, on a GPU.

For each case (spec:layout:NxK, bf16 weights and activations) and token count T, every time is
the median per call of a CUDA graph replaying the call 20 times (no host overhead in any row):

  torch pair    cuBLAS dW + torch AdamW(fused=True, capturable=True)   (adamw:bf16 only)
  cuBLAS dW     the bf16 GEMM dW = dyᵀ·x alone
  our step      the spec's element-wise step kernel alone, on a bf16 gradient
  then for each tile config:
  fused         the fused kernel
  token loop    the same tiles' token loop alone, each dW tile stored as bf16 (a GEMM)
  epilogue      the same kernel with no tokens: loads, update and stores of W and state only
  ws            (--ws, adamw:bf16 only) a persistent fused kernel whose tile loop Triton warp-specializes

    python -m forge_dsl.bench.anatomy --case adamw:bf16:4096x4096 --tokens 512,2048,8192 [--config 64,128,128,16,3,1,1]
        [--ws] [--json FILE]

fused ≈ token loop + epilogue means nothing overlaps the epilogue; fused ≈ max of the two means
co-resident programs hide it. The tiles are the Triton kernel's (`fused_config(..., hopper=False)`), also
on Hopper, where `forge-bench kernel` times the warp-specialized kernel instead. Scratch weights and state
only (never live ones). The same buffers are replayed: a layer whose weights and state fit in the L2 (k/v)
is timed warm; `forge-bench kernel --timing graph` rotates copies past the L2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys

import torch
import triton
import triton.language as tl

import forge_dsl
from forge_dsl import kernels
from forge_dsl.spec.keywords import resolve_hypers
from forge_dsl.generated import adamw as adamw_module
from forge_dsl.kernels import TileConfig
from forge_dsl.kernels.kernel_calls import kernel_host_values
from forge_dsl.kernels.policy import fused_config, interpreting
from forge_dsl.kernels.tile_kernels import apply_tile, load_tile
from forge_dsl.kernels.tile_lib import accumulate_dw, accumulate_dw_halves, tile_at, tile_offsets

from . import kernel as bench_kernel
from .common import device_name, git_commit, graph_ms as common_graph_ms

CONFIGS = {
    "64x64 w4 s4 TMA": TileConfig(64, 64, 64, 8, 4, 4, tma=True),
    "128x128 halves w8 s4 TMA": TileConfig(64, 128, 128, 8, 8, 4, k_halves=True, tma=True),
    "128x128 halves w8 s3 TMA ≤128 regs": TileConfig(64, 128, 128, 8, 8, 3, k_halves=True, tma=True, maxnreg=128),
    "128x128 halves w8 s2 TMA ≤128 regs": TileConfig(64, 128, 128, 8, 8, 2, k_halves=True, tma=True, maxnreg=128),
    "128x128 w8 s4 TMA": TileConfig(64, 128, 128, 8, 8, 4, tma=True),
    "128x128 w8 s3 TMA ≤128 regs": TileConfig(64, 128, 128, 8, 8, 3, tma=True, maxnreg=128),
    "64x128 halves w8 s3 TMA": TileConfig(64, 64, 128, 8, 8, 3, k_halves=True, tma=True),
}
# (BT, BN, BK, warps, stages) of the warp-specialized persistent experiment.
WS_CONFIGS = {"ws 128x128 w4 s3": (64, 128, 128, 4, 3), "ws 128x64 w4 s4": (64, 128, 64, 4, 4)}


@triton.jit
def token_loop_only(X, DY, OUT, T, N, K, stride_xt, stride_xk, stride_dyt, stride_dyn,
                    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
                    K_HALVES: tl.constexpr, TMA: tl.constexpr, DOT_FP32: tl.constexpr):
    """OUT [N, K] (bf16) = DY[T, N]ᵀ · X[T, K]: the fused kernel's token loop with a plain store for an epilogue."""
    offs_n, offs_k, n_start, k_start = tile_at(tl.program_id(0), N, K, BLOCK_N, BLOCK_K, GROUP_N)
    if K_HALVES:
        HALF_K: tl.constexpr = BLOCK_K // 2
        acc0, acc1 = accumulate_dw_halves(X, DY, n_start, k_start, T, N, K, stride_xt, stride_xk, stride_dyt,
                                          stride_dyn, DOT_FP32, None, TMA, BLOCK_T, BLOCK_N, HALF_K)
        offs, mask = tile_offsets(offs_n, k_start + tl.arange(0, HALF_K), N, K)
        tl.store(OUT + offs, acc0.to(tl.bfloat16), mask=mask)
        offs, mask = tile_offsets(offs_n, k_start + HALF_K + tl.arange(0, HALF_K), N, K)
        tl.store(OUT + offs, acc1.to(tl.bfloat16), mask=mask)
    else:
        acc = accumulate_dw(X, DY, n_start, k_start, T, N, K, stride_xt, stride_xk, stride_dyt, stride_dyn,
                            DOT_FP32, None, TMA, BLOCK_T, BLOCK_N, BLOCK_K)
        offs, mask = tile_offsets(offs_n, offs_k, N, K)
        tl.store(OUT + offs, acc.to(tl.bfloat16), mask=mask)


@triton.jit
def adamw_persistent_ws(X, DY, W, STATES, HOST, seed, T, N, K, UPDATE: tl.constexpr,
                        NUM_PROGRAMS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr, DOT_FP32: tl.constexpr):
    """`tile_kernels.fused` with AdamW's update (bf16 weights and state, TMA) as a persistent loop over tiles
    that Triton warp-specializes (a producer warp group for the TMA loads, consumers for dot + epilogue)."""
    num_tiles = tl.cdiv(N, BLOCK_N) * tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, warp_specialize=True):
        offs_n, offs_k, n_start, k_start = tile_at(tile, N, K, BLOCK_N, BLOCK_K, GROUP_N)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for t0 in range(0, T, BLOCK_T):
            b_dy = DY.load([t0, n_start])
            b_x = X.load([t0, k_start])
            if DOT_FP32:  # the interpreter's bf16 dot is wrong
                b_dy = b_dy.to(tl.float32)
                b_x = b_x.to(tl.float32)
            acc = tl.dot(tl.trans(b_dy), b_x, acc)
        offs, mask = tile_offsets(offs_n, offs_k, N, K)
        # bf16 state (layout 1): no block scales, so the storage and `offs` stand in for the unread scales, and no
        # 4-bit codes (NIBBLE_WORDS False)
        r_w, raws, scales = load_tile(W, STATES, STATES, offs, mask, offs, True, (1, 1), False, BLOCK_N, BLOCK_K)
        apply_tile(W, STATES, STATES, HOST, acc, r_w, raws, scales, offs, mask, offs, seed, UPDATE, True, True,
                   (1, 1), False, BLOCK_N, BLOCK_K)


def graph_ms(fn) -> float:
    """`forge_dsl.bench.common.graph_ms` (GPU time per call from a CUDA graph of 20 calls); NaN if it fails."""
    try:
        return common_graph_ms(fn, torch.device("cuda"))
    except Exception as err:  # out of resources or a compile failure: a result too
        print(f"  {type(err).__name__}: {str(err)[:300]}", flush=True)
        return float("nan")


def run_case(spec_name: str, layout: str, N: int, K: int, T: int, rows: list, configs: dict, ws: bool) -> None:
    spec = forge_dsl.load_spec(spec_name)
    kw = bench_kernel.hypers_for(spec_name)
    shape = bench_kernel.Shape(f"{N}x{K}", N, K)
    cuda = torch.device("cuda")
    x, dy = bench_kernel.make_inputs(T, shape, cuda)
    w = bench_kernel.scratch_weight(shape, cuda)
    state = forge_dsl.init_state(spec, w, layout=layout, **kw)
    dw = torch.empty(N, K, device="cuda", dtype=torch.bfloat16)

    def add(what, ms):
        rows.append({"spec": spec_name, "layout": layout, "N": N, "K": K, "T": T, "what": what, "ms": ms})
        print(json.dumps(rows[-1]), flush=True)

    add("floor", bench_kernel.floor_ms(T, N, K, bench_kernel.moved_bytes(spec_name, shape, T, layout))["floor_ms"])
    add("cuBLAS dW", graph_ms(lambda: torch.matmul(dy.t(), x, out=dw)))
    add("our step", graph_ms(lambda: kernels.step(spec, w, dw, state, step=1, **kw)))
    if spec_name == "adamw" and layout == "bf16":
        p = torch.nn.Parameter(w.clone())
        p.grad = dw
        opt = torch.optim.AdamW([p], lr=1e-4, fused=True, capturable=True)
        add("torch step", graph_ms(opt.step))
        add("torch pair", graph_ms(lambda: (torch.matmul(dy.t(), x, out=dw), opt.step())))
        del p, opt
    # the Triton kernel's default: its token loop and epilogue are what this script takes apart (the
    # warp-specialized kernel runs them in different warps at once; docs/PERF.md, v7)
    default = fused_config(T, N, K, w.device, layout == "int8", hopper=False)
    add("epilogue, nearest rounding | default",
        graph_ms(lambda: kernels.fused_linear_step(spec, x[:0], dy[:0], w, state, step=1, config=default,
                                                   rounding="nearest", **kw)))
    for name, cfg in {"default": default, **configs}.items():
        add(f"fused | {name}", graph_ms(lambda: kernels.fused_linear_step(spec, x, dy, w, state, step=1, config=cfg,
                                                                         **kw)))
        add(f"epilogue | {name}", graph_ms(lambda: kernels.fused_linear_step(spec, x[:0], dy[:0], w, state, step=1,
                                                                            config=cfg, **kw)))
        add(f"token loop | {name}", graph_ms(lambda: launch_token_loop(x, dy, dw, cfg)))
    if ws and spec_name == "adamw" and layout == "bf16":
        for name, cfg in WS_CONFIGS.items():
            add(name, graph_ms(lambda: launch_adamw_ws(x, dy, w, state, cfg)))


def launch_token_loop(x, dy, out, cfg: TileConfig) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    T, K = x.shape
    N = dy.shape[1]
    xa, dya = x, dy
    if cfg.tma:
        x_block, dy_block = cfg.tma_blocks
        xa = TensorDescriptor.from_tensor(x, x_block)
        dya = TensorDescriptor.from_tensor(dy, dy_block)
    grid = (triton.cdiv(N, cfg.block_n) * triton.cdiv(K, cfg.block_k),)
    token_loop_only[grid](xa, dya, out, T, N, K, x.stride(0), x.stride(1), dy.stride(0), dy.stride(1),
                          BLOCK_T=cfg.block_t, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_N=cfg.group_n,
                          K_HALVES=cfg.k_halves, TMA=cfg.tma, DOT_FP32=interpreting(), num_warps=cfg.num_warps,
                          num_stages=cfg.num_stages, maxnreg=cfg.maxnreg)


def launch_adamw_ws(x, dy, w, state, cfg, *, seed: int = 1234, programs: int = 0) -> None:
    """One step (step 1, lr 1e-4) of `adamw_persistent_ws` on bf16 x [T, K], dy [T, N], w [N, K] and bf16
    state; cfg = (BT, BN, BK, warps, stages); `programs` defaults to one per SM."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bt, bn, bk, warps, stages = cfg
    T, K = x.shape
    N = dy.shape[1]
    exports, _ = adamw_module.host_v0(resolve_hypers(forge_dsl.load_spec("adamw"), {"lr": 1e-4}).host_inputs, 1, {})
    exports = kernel_host_values(exports)  # as every launch hands them to a kernel
    programs = min(programs or torch.cuda.get_device_properties(w.device).multi_processor_count,
                   triton.cdiv(N, bn) * triton.cdiv(K, bk))
    adamw_persistent_ws[(programs,)](
        TensorDescriptor.from_tensor(x, [bt, bk]), TensorDescriptor.from_tensor(dy, [bt, bn]),
        w.view(torch.int16), (state["exp_avg"].view(torch.int16), state["exp_avg_sq"].view(torch.int16)),
        exports, seed, T, N, K, UPDATE=adamw_module.update_v0, NUM_PROGRAMS=programs, BLOCK_T=bt, BLOCK_N=bn, BLOCK_K=bk, GROUP_N=8,
        DOT_FP32=interpreting(), num_warps=warps, num_stages=stages)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m forge_dsl.bench.anatomy", description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", help="spec:layout:NxK (repeatable; default adamw:bf16:4096x4096)")
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--config", action="append", default=[],
                    help="a tile config to time beside the default, "
                         "BT,BN,BK,WARPS,STAGES[,HALVES[,TMA]][,split=S][,maxnreg=R] "
                         "(repeatable; default: the list in CONFIGS)")
    ap.add_argument("--ws", action="store_true", help="also time the warp-specialized persistent experiment")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    configs = {c: TileConfig.parse(c) for c in args.config} if args.config else CONFIGS
    data = {"command": shlex.join(["python", "-m", "forge_dsl.bench.anatomy", *(argv if argv is not None else sys.argv[1:])]),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "device": device_name(torch.device("cuda")), "torch": torch.__version__, "triton": triton.__version__,
            "git_commit": git_commit(), "timing": "CUDA graph of 20 calls, median of 10 replays, ms per call",
            "rows": []}
    rows = data["rows"]
    for case in args.case or ["adamw:bf16:4096x4096"]:
        spec_name, layout, shape = case.split(":")
        N, K = (int(v) for v in shape.split("x"))
        for T in (int(t) for t in args.tokens.split(",")):
            run_case(spec_name, layout, N, K, T, rows, configs, args.ws)
            torch.cuda.empty_cache()
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(data, f, indent=1)
    print(summary(rows))


def summary(rows: list) -> str:
    """One line per (case, T, config): fused, token loop and epilogue ms, and how much of the shorter
    part the fused kernel hides (1: all of it, 0: none, < 0: the parts slow each other down)."""
    by_case: dict = {}
    for r in rows:
        by_case.setdefault((r["spec"], r["layout"], r["N"], r["K"], r["T"]), {})[r["what"]] = r["ms"]
    lines = [f"{'case':>24} {'T':>5}  {'config':<44} {'fused':>7} {'loop':>7} {'epi':>7} {'hidden':>6} "
             f"{'vs torch':>8}"]
    for (spec, layout, N, K, T), v in by_case.items():
        lines.append(f"{spec}:{layout}:{N}x{K}".rjust(24) + f" {T:>5}  floor {v['floor']:.3f}, cuBLAS dW "
                     f"{v['cuBLAS dW']:.3f}, our step {v['our step']:.3f}, "
                     f"torch pair {v.get('torch pair', float('nan')):.3f}")
        for name in (w[len("fused | "):] for w in v if w.startswith("fused | ")):
            f, t, e = v[f"fused | {name}"], v[f"token loop | {name}"], v[f"epilogue | {name}"]
            lines.append(f"{'':>24} {'':>5}  {name:<44} {f:>7.3f} {t:>7.3f} {e:>7.3f} {(t + e - f) / min(t, e):>6.2f} "
                         f"{v.get('torch pair', float('nan')) / f:>7.2f}×")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
