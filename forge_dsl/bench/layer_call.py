"""One linear layer's update timed as a Python call, host included: FORGE against cuBLAS dW + torch fused AdamW.

    python -m forge_dsl.bench.layer_call [--tokens 512,2048] [--layout bf16] [--calls 50] [--rounds 3] [--shapes q_o,k_v]

For every Llama-3.1-8B linear layer shape (q/o, k/v, gate/up, down, lm_head), bf16 weights and activations:

  forge   `forge_dsl.kernels.linear_step("adamw", x, dy, w, state, step=s, ...)`, the call ForgeOptimizer makes
          in backward (the path `auto_linear_path` picks, reused launches where they apply);
  torch   `torch.matmul(dy.t(), x, out=w.grad)` then `torch.optim.AdamW([w], fused=True).step()`: the dW
          autograd writes and the optimizer step that reads it (bf16 state, as torch keeps it for a bf16
          parameter).

Each is called `calls` times back to back and synchronized once: ms per call, wall clock, what a training step
pays. The two alternate for `rounds` rounds and the median of each is kept; the ratio torch / forge is the
speedup (issue F's target: >= 1.0 on every shape). Scratch tensors only; needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import forge_dsl
from forge_dsl.kernels import steps

SHAPES = {"q_o": (4096, 4096), "k_v": (1024, 4096), "gate_up": (14336, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
HYPERS = dict(lr=1e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _per_call_ms(call, calls: int) -> float:
    _sync()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    _sync()
    return (time.perf_counter() - start) * 1e3 / calls


def measure(n: int, k: int, tokens: int, layout: str, calls: int, rounds: int) -> dict:
    """Median ms per call of each method for a weight [n, k] and activations [tokens, k] / [tokens, n]."""
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: a smoke run in the interpreter
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, k, device=device, generator=gen).to(torch.bfloat16)
    dy = torch.randn(tokens, n, device=device, generator=gen).to(torch.bfloat16)
    w_forge = (torch.randn(n, k, device=device, generator=gen) * 0.02).to(torch.bfloat16)
    state = forge_dsl.init_state("adamw", w_forge, layout=layout)
    step = [0]

    def forge():
        step[0] += 1
        steps.linear_step("adamw", x, dy, w_forge, state, step=step[0], **HYPERS)

    w_torch = torch.nn.Parameter(w_forge.clone())
    w_torch.grad = torch.empty_like(w_torch)
    opt = torch.optim.AdamW([w_torch], fused=w_torch.is_cuda, **HYPERS)

    def torch_step():
        torch.matmul(dy.t(), x, out=w_torch.grad)
        opt.step()

    for fn in (forge, torch_step):  # compile, autotune, caches
        for _ in range(5):
            fn()
    times = {"forge": [], "torch": []}
    for _ in range(rounds):
        times["forge"].append(_per_call_ms(forge, calls))
        times["torch"].append(_per_call_ms(torch_step, calls))
    return {name: statistics.median(v) for name, v in times.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m forge_dsl.bench.layer_call", description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="512,2048")
    ap.add_argument("--layout", default="bf16", help="FORGE's state layout (default bf16)")
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {', '.join(SHAPES)}, or "
                    "NxK (default: all)")
    args = ap.parse_args(argv)
    shapes = {name: SHAPES[name] if name in SHAPES else tuple(int(v) for v in name.split("x"))
              for name in args.shapes.split(",")}
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (interpreter)"
    print(f"{device} | torch {torch.__version__} | state {args.layout} | "
          f"{args.calls} calls × {args.rounds} rounds, median")
    print("| layer | W (N×K) | T | forge ms | cuBLAS dW + AdamW(fused) ms | speedup |")
    print("|---|---|---|---|---|---|")
    for tokens in (int(t) for t in args.tokens.split(",")):
        for name, (n, k) in shapes.items():
            r = measure(n, k, tokens, args.layout, args.calls, args.rounds)
            print(f"| {name} | {n}×{k} | {tokens} | {r['forge']:.3f} | {r['torch']:.3f} | "
                  f"{r['torch'] / r['forge']:.2f} |", flush=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
