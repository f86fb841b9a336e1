"""Tile-config sweep of the fused kernel on a GPU: which (BLOCK_N, BLOCK_K, BLOCK_T, warps, stages) is fastest.

Tuning runs on scratch copies of the weight and state (never on live weights).
Usage: python bench/sweep_tiles.py [--spec adamw] [--layout bf16] [--shape 4096x4096] [--tokens 512,2048,8192]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

import forge_dsl
from forge_dsl import kernels
from forge_dsl.kernels import TileConfig

# (config, rounding): TileConfig(block_t, block_n, block_k, group_n, num_warps, num_stages).
# docs/PERF.md v1 has the results of this list and of the split-epilogue variants it replaced.
CONFIGS = [
    (TileConfig(64, 128, 128, 8, 8, 3), "stochastic"),  # v0 default, and the default above 4096 tokens
    (TileConfig(64, 128, 128, 8, 8, 3), "nearest"),  # what the random bits cost
    (TileConfig(128, 64, 64, 8, 4, 3), "stochastic"),  # the default up to 4096 tokens
    (TileConfig(128, 64, 64, 8, 4, 3), "nearest"),
    (TileConfig(64, 64, 64, 8, 4, 4), "stochastic"),
    (TileConfig(64, 64, 64, 8, 2, 4), "stochastic"),
    (TileConfig(64, 64, 128, 8, 4, 3), "stochastic"),
    (TileConfig(32, 64, 128, 8, 4, 4), "stochastic"),
    (TileConfig(64, 128, 64, 8, 4, 3), "stochastic"),
    (TileConfig(64, 128, 256, 8, 8, 3), "stochastic"),
]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="adamw")
    ap.add_argument("--layout", default="bf16")
    ap.add_argument("--shape", default="4096x4096")
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    N, K = (int(v) for v in args.shape.split("x"))
    spec = forge_dsl.load_spec(args.spec)
    kw = {"lr": 1e-4, **({"momentum": 0.9} if args.spec == "sgd_momentum" else {})}
    rows = []
    for T in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(T, N, device="cuda", dtype=torch.bfloat16) * 1e-3
        w = (torch.randn(N, K, device="cuda") * 0.02).to(torch.bfloat16)  # scratch weight
        state = forge_dsl.init_state(spec, w, layout=args.layout, **kw)
        for cfg, rounding in CONFIGS:
            try:
                ms = triton.testing.do_bench(
                    lambda: kernels.fused_linear_step(spec, x, dy, w, state, step=1, config=cfg, rounding=rounding,
                                                      **kw),
                    warmup=10, rep=50, return_mode="median")
            except Exception as err:  # out of resources: a result too
                ms = float("nan")
                print(f"T={T} {cfg}: {type(err).__name__}: {str(err)[:120]}")
            rows.append({"T": T, "config": dict(cfg.__dict__), "rounding": rounding, "ms": ms})
            print(json.dumps(rows[-1]), flush=True)
    print(f"\nfused {args.spec} {args.layout} state, W {N}x{K}")
    print(f"{'T':>6} {'BT':>4} {'BN':>4} {'BK':>4} {'warps':>5} {'stages':>6} {'rounding':>10} {'ms':>8}")
    for r in rows:
        c = r["config"]
        print(f"{r['T']:>6} {c['block_t']:>4} {c['block_n']:>4} {c['block_k']:>4} {c['num_warps']:>5} "
              f"{c['num_stages']:>6} {r['rounding']:>10} {r['ms']:>8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    best = best_config(rows)
    if best is not None:
        c = best
        print(f"best stochastic config over all T (geometric mean): --config "
              f"{c['block_t']},{c['block_n']},{c['block_k']},{c['num_warps']},{c['num_stages']}")


def best_config(rows):
    """The stochastic-rounding config with the lowest geometric-mean time over the token counts."""
    import math

    by_config = {}
    for r in rows:
        if r["rounding"] != "stochastic" or r["ms"] != r["ms"]:
            continue
        key = tuple(sorted(r["config"].items()))
        by_config.setdefault(key, []).append(r["ms"])
    n = max((len(v) for v in by_config.values()), default=0)
    scored = [(math.exp(sum(map(math.log, v)) / len(v)), dict(k)) for k, v in by_config.items() if len(v) == n]
    return min(scored, key=lambda x: x[0])[1] if scored else None


if __name__ == "__main__":
    main()
