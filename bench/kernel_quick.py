"""Quick side-by-side timing of one linear layer's weight update on a GPU (the start of `forge-bench kernel`).

For W = N × K (bf16), state in bf16, T tokens, median ms by triton.testing.do_bench:
  fused    : our tile-fused kernel (dW never stored)
  ours     : cuBLAS dW (torch.matmul) + our generated element-wise step kernel
  torch    : cuBLAS dW + torch.optim.AdamW(fused=True) step (AdamW only)
  floor    : max(2·T·N·K / 790 TFLOP/s, bytes / 4.3 TB/s), bytes = X, dY read once, W and state read+written

Usage: python bench/kernel_quick.py [--specs adamw,lion] [--shapes 4096x4096] [--tokens 512,2048,8192]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton

import forge_dsl
from forge_dsl import kernels

PEAK_FLOPS = 790e12
PEAK_BYTES = 4.3e12


def floor_ms(T, N, K, n_states, state_bytes=2, w_bytes=2, act_bytes=2):
    flops = 2 * T * N * K
    moved = T * (N + K) * act_bytes + 2 * N * K * (w_bytes + n_states * state_bytes)
    return max(flops / PEAK_FLOPS, moved / PEAK_BYTES) * 1e3


def bench_one(spec_name, N, K, T, layout="bf16"):
    spec = forge_dsl.load_spec(spec_name)
    kw = {"lr": 1e-4}
    if spec_name == "sgd_momentum":
        kw["momentum"] = 0.9
    dev = "cuda"
    w = (torch.randn(N, K, device=dev) * 0.02).to(torch.bfloat16)
    x = torch.randn(T, K, device=dev, dtype=torch.bfloat16)
    dy = torch.randn(T, N, device=dev, dtype=torch.bfloat16) * 1e-3
    state = forge_dsl.init_state(spec, w, layout=layout, **kw)
    n_states = len([s for s in spec.states if s.name in state])
    step = [1]

    def fused():
        kernels.fused_linear_step(spec, x, dy, w, state, step=step[0], **kw)

    w2 = w.clone()
    state2 = forge_dsl.init_state(spec, w2, layout=layout, **kw)

    def ours():
        g = dy.T @ x
        kernels.step(spec, w2, g, state2, step=step[0], **kw)

    out = {"spec": spec_name, "N": N, "K": K, "T": T, "layout": layout,
           "fused_ms": triton.testing.do_bench(fused, warmup=25, rep=100, return_mode="median"),
           "ours_ms": triton.testing.do_bench(ours, warmup=25, rep=100, return_mode="median"),
           "floor_ms": floor_ms(T, N, K, n_states, state_bytes={"bf16": 2, "fp32": 4, "int8": 1}[layout])}
    if spec_name == "adamw" and layout in ("bf16", "fp32"):
        p = torch.nn.Parameter(w.clone().to(torch.bfloat16))
        opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
        p.grad = (dy.T @ x)
        opt.step()  # creates state
        if layout == "bf16":
            for k in ("exp_avg", "exp_avg_sq"):
                opt.state[p][k] = opt.state[p][k].to(torch.bfloat16)

        def torch_pair():
            p.grad = dy.T @ x
            opt.step()

        out["torch_ms"] = triton.testing.do_bench(torch_pair, warmup=25, rep=100, return_mode="median")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--specs", default="adamw")
    ap.add_argument("--shapes", default="4096x4096,14336x4096")
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--layouts", default="bf16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    for spec in args.specs.split(","):
        for shape in args.shapes.split(","):
            N, K = (int(v) for v in shape.split("x"))
            for T in (int(t) for t in args.tokens.split(",")):
                for layout in args.layouts.split(","):
                    r = bench_one(spec, N, K, T, layout)
                    rows.append(r)
                    print(json.dumps(r), flush=True)
    print(f"\n{'spec':<13}{'W':>12}{'T':>6}{'layout':>7}{'fused':>9}{'dW+ours':>9}{'dW+torch':>9}{'floor':>8}"
          f"{'vs ours':>9}{'vs torch':>9}{'/floor':>8}")
    for r in rows:
        t = r.get("torch_ms")
        print(f"{r['spec']:<13}{r['N']:>6}x{r['K']:<5}{r['T']:>6}{r['layout']:>7}{r['fused_ms']:>9.3f}{r['ours_ms']:>9.3f}"
              f"{(t if t else float('nan')):>9.3f}{r['floor_ms']:>8.3f}{r['ours_ms'] / r['fused_ms']:>8.2f}x"
              f"{(t / r['fused_ms'] if t else float('nan')):>8.2f}x{r['fused_ms'] / r['floor_ms']:>7.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
