"""A few fused calls on the GPU for `ncu` to profile (docs/PERF.md, v12c).

    ncu --clock-control none -k regex:fused_ws -s 2 -c 1 --section SpeedOfLight \
        python -m forge_dsl.bench.ncu_probe --spec sgd --shape 4096x4096 --tokens 2048

Each call is one `fused_linear_step`: x [T, K] and dy [T, N] bf16 activations, W [N, K] bf16, the spec's
state in `--layout`; `-s 2 -c 1` profiles the third of the `--calls` launches (compiled and warm by then).
Scratch tensors only.
"""

from __future__ import annotations

import argparse

import torch

import forge_dsl
from forge_dsl.kernels.steps import fused_linear_step


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m forge_dsl.bench.ncu_probe", description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="adamw", help="built-in name or .fopt path (default: adamw)")
    ap.add_argument("--shape", default="4096x4096", help="NxK of the weight (default: 4096x4096)")
    ap.add_argument("--tokens", type=int, default=2048, help="T (default: 2048)")
    ap.add_argument("--layout", default="bf16", help="state layout: fp32, bf16 or int8 (default: bf16)")
    ap.add_argument("--calls", type=int, default=4, help="fused calls, steps 1.. (default: 4)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("forge_dsl.bench.ncu_probe profiles the compiled kernel: it needs a CUDA device")
    N, K = (int(v) for v in args.shape.lower().split("x"))
    g = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(N, K, device="cuda", generator=g) * 0.02).bfloat16()
    x = torch.randn(args.tokens, K, device="cuda", generator=g).bfloat16()
    dy = (torch.randn(args.tokens, N, device="cuda", generator=g) * 1e-3).bfloat16()
    state = forge_dsl.init_state(args.spec, weight, layout=args.layout)
    for step in range(1, args.calls + 1):
        fused_linear_step(args.spec, x, dy, weight, state, step=step, lr=1e-3)
    torch.cuda.synchronize()
    print("done", args.spec, args.shape, args.tokens, args.layout)


if __name__ == "__main__":
    main()
