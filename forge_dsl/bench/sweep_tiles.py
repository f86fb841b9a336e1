"""Config sweeps on a GPU: tile configs of the fused kernel, block shapes of the element-wise step kernel.

Tuning runs on scratch copies of the weight and state (never on live weights).
Usage:
  python -m forge_dsl.bench.sweep_tiles [--case adamw:bf16:4096x4096 ...] [--tokens 512,2048,8192] [--json FILE]
  python -m forge_dsl.bench.sweep_tiles --step [--case adamw:bf16:4096x4096 ...]   (element-wise kernel vs torch fused;
      GPU time from CUDA graphs)
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import triton

import forge_dsl
from forge_dsl import kernels
from forge_dsl.kernels import TileConfig, kernel_calls

from .common import graph_ms

# TileConfig(block_t, block_n, block_k, group_n, num_warps, num_stages, k_halves, tma, ...). docs/PERF.md (v1-v4) has
# the results of this list and of the lists it replaced (loading W and state after the token loop; persistent
# programs that load the next tile a whole tile ahead; an L2 prefetch of W and state: slower or no faster, removed).
CONFIGS = [
    TileConfig(64, 64, 64, 8, 4, 4),  # v2 default up to 4096 tokens (bf16 and fp32 state)
    TileConfig(64, 64, 64, 8, 4, 4, tma=True),
    TileConfig(128, 64, 64, 8, 4, 3),  # v2 default up to 4096 tokens with int8 state
    TileConfig(128, 64, 64, 8, 4, 3, tma=True),
    TileConfig(64, 128, 128, 8, 8, 4),  # v2 default above 4096 tokens (255 registers, spills)
    TileConfig(64, 128, 128, 8, 8, 4, tma=True),
    TileConfig(64, 128, 128, 8, 8, 4, k_halves=True),  # halves: 181 registers, no spills
    TileConfig(64, 128, 128, 8, 8, 4, k_halves=True, tma=True),
    TileConfig(64, 128, 128, 8, 8, 3, k_halves=True, tma=True),
    TileConfig(128, 128, 128, 8, 8, 3, k_halves=True, tma=True),
    TileConfig(64, 64, 128, 8, 8, 4, k_halves=True, tma=True),  # halves: 127 registers, two programs per SM
    TileConfig(64, 64, 128, 8, 8, 3, k_halves=True, tma=True),
    # v4 default from 1025 tokens: the whole tile accumulated, its epilogue in quarter slices, two programs per SM
    TileConfig(64, 128, 128, 8, 8, 3, tma=True, epilogue_split=4, maxnreg=128),
]
# (BLOCK_N, BLOCK_K, num_warps) of the element-wise kernel; policy.step_config picks one by shape.
STEP_CONFIGS = [(16, 256, 8), (16, 256, 4), (8, 256, 4), (32, 256, 8), (8, 512, 4), (16, 512, 8), (32, 128, 4),
                (64, 64, 4), (64, 128, 8), (8, 256, 8), (4, 256, 4), (8, 128, 4), (16, 128, 8), (4, 512, 8),
                (2, 512, 4), (16, 64, 4), (32, 64, 8), (4, 128, 2), (2, 256, 2)]


def hypers(spec_name: str) -> dict:
    return {"lr": 1e-4, **({"momentum": 0.9} if spec_name == "sgd_momentum" else {})}


def bench(fn, graph: bool = False) -> float:
    """Median ms of `fn`: triton's do_bench (host launch time included), or with `graph` the GPU time
    per call from a CUDA graph (the step kernel is shorter than its launch); NaN if it fails."""
    try:
        if graph:
            return graph_ms(fn, torch.device("cuda"))
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
    except Exception as err:  # out of resources: a result too
        print(f"  {type(err).__name__}: {str(err)[:160]}")
        return float("nan")


def sweep_fused(spec_name, layout, N, K, tokens, rows):
    spec = forge_dsl.load_spec(spec_name)
    kw = hypers(spec_name)
    for T in tokens:
        x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(T, N, device="cuda", dtype=torch.bfloat16) * 1e-3
        w = (torch.randn(N, K, device="cuda") * 0.02).to(torch.bfloat16)  # scratch weight
        state = forge_dsl.init_state(spec, w, layout=layout, **kw)
        if spec_name == "adamw" and layout == "bf16":  # the baseline, side by side
            p = torch.nn.Parameter(w.clone())
            opt = torch.optim.AdamW([p], lr=1e-4, fused=True)

            def torch_pair():
                p.grad = dy.T @ x
                opt.step()
            rows.append({"kind": "torch", "spec": spec_name, "layout": layout, "N": N, "K": K, "T": T,
                         "config": "cuBLAS dW + torch AdamW(fused=True)", "ms": bench(torch_pair)})
            print(json.dumps(rows[-1]), flush=True)
            del p, opt
        for cfg in CONFIGS:
            ms = bench(lambda: kernels.fused_linear_step(spec, x, dy, w, state, step=1, config=cfg, **kw))
            rows.append({"kind": "fused", "spec": spec_name, "layout": layout, "N": N, "K": K, "T": T,
                         "config": dict(cfg.__dict__), "ms": ms})
            print(json.dumps(rows[-1]), flush=True)


def sweep_step(spec_name, layout, N, K, rows):
    spec = forge_dsl.load_spec(spec_name)
    kw = hypers(spec_name)
    w = (torch.randn(N, K, device="cuda") * 0.02).to(torch.bfloat16)
    g = (torch.randn(N, K, device="cuda") * 1e-3).to(torch.bfloat16)
    state = forge_dsl.init_state(spec, w, layout=layout, **kw)
    original = kernel_calls.step_config
    try:
        for bn, bk, warps in STEP_CONFIGS:
            kernel_calls.step_config = lambda rows_, cols, device, c=(bn, bk, warps): c
            ms = bench(lambda: kernels.step(spec, w, g, state, step=1, **kw), graph=True)
            rows.append({"kind": "step", "spec": spec_name, "layout": layout, "N": N, "K": K,
                         "config": [bn, bk, warps], "ms": ms})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        kernel_calls.step_config = original
    if spec_name == "adamw" and layout == "bf16":
        p = torch.nn.Parameter(w.clone())
        p.grad = g
        opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
        rows.append({"kind": "step", "spec": spec_name, "layout": layout, "N": N, "K": K,
                     "config": "torch AdamW(fused=True)", "ms": bench(opt.step)})
        print(json.dumps(rows[-1]), flush=True)
        opt_g = torch.optim.AdamW([p], lr=1e-4, fused=True, capturable=True)
        rows.append({"kind": "step", "spec": spec_name, "layout": layout, "N": N, "K": K,
                     "config": "torch AdamW(fused=True, capturable=True), CUDA graph",
                     "ms": bench(opt_g.step, graph=True)})
        print(json.dumps(rows[-1]), flush=True)


def print_table(rows):
    print(f"\n{'kind':>5} {'spec':>8} {'layout':>6} {'W':>11} {'T':>5}  {'config':<52} {'ms':>8}")
    for r in rows:
        c = r["config"]
        if isinstance(c, dict):
            c = (f"BT{c['block_t']} {c['block_n']}x{c['block_k']} w{c['num_warps']} s{c['num_stages']}"
                 f"{' halves' if c.get('k_halves') else ''}{' TMA' if c.get('tma') else ''}"
                 f"{' split=' + str(c['epilogue_split']) if c.get('epilogue_split', 1) > 1 else ''}"
                 f"{' ≤' + str(c['maxnreg']) + ' regs' if c.get('maxnreg') else ''}")
        print(f"{r['kind']:>5} {r['spec']:>8} {r['layout']:>6} {str(r['N']) + 'x' + str(r['K']):>11} "
              f"{r.get('T', ''):>5}  {str(c):<52} {r['ms']:>8.3f}")


def best_config(rows):
    """The fused config with the lowest geometric-mean time over all fused rows (None if none ran everywhere)."""
    by_config = {}
    for r in rows:
        if r["kind"] == "fused" and r["ms"] == r["ms"]:
            by_config.setdefault(tuple(sorted(r["config"].items())), []).append(r["ms"])
    n = max((len(v) for v in by_config.values()), default=0)
    scored = [(math.exp(sum(map(math.log, v)) / len(v)), dict(k)) for k, v in by_config.items() if len(v) == n]
    return min(scored, key=lambda x: x[0])[1] if scored else None


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m forge_dsl.bench.sweep_tiles")
    ap.add_argument("--case", action="append", help="spec:layout:NxK (repeatable; default adamw:bf16:4096x4096)")
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--step", action="store_true", help="sweep the element-wise step kernel instead")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    for case in args.case or ["adamw:bf16:4096x4096"]:
        spec_name, layout, shape = case.split(":")
        N, K = (int(v) for v in shape.split("x"))
        if args.step:
            sweep_step(spec_name, layout, N, K, rows)
        else:
            sweep_fused(spec_name, layout, N, K, [int(t) for t in args.tokens.split(",")], rows)
        torch.cuda.empty_cache()
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    best = best_config(rows)
    if best is not None:
        print("best fused config over all cases (geometric mean): --config "
              f"{best['block_t']},{best['block_n']},{best['block_k']},{best['num_warps']},{best['num_stages']},"
              f"{int(best['k_halves'])},{int(best['tma'])},split={best['epilogue_split']}"
              f"{',maxnreg=' + str(best['maxnreg']) if best['maxnreg'] else ''}")


if __name__ == "__main__":
    main()
