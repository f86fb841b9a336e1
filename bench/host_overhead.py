"""Host time of one `linear_step` call on a GPU: what a training step pays per layer outside the kernels.

    python bench/host_overhead.py                 # the table below
    python bench/host_overhead.py --profile       # and cProfile's top functions for one case

For AdamW with bf16 and int8 state, on a 1024×4096 layer at 16 and 512 tokens (GPU work far shorter than
the call: the host sets the pace) and a 4096² layer at 2048 tokens, `calls` steps are issued back to back
with one synchronize at the end: "host" is the time to issue them, "wall" until the GPU has done them, both
per call. Where host ≈ wall, the GPU waited for the host. docs/PERF.md, v9c.
"""

import argparse
import cProfile
import pstats
import time

import torch

import forge_dsl
from forge_dsl.kernels import launch

CASES = [("bf16", 1024, 4096, 16), ("bf16", 1024, 4096, 512), ("bf16", 4096, 4096, 2048),
         ("int8", 1024, 4096, 16), ("int8", 1024, 4096, 512), ("int8", 4096, 4096, 2048)]
HYPERS = dict(lr=1e-5, betas=(0.9, 0.999), weight_decay=0.1, seed=1)


def time_calls(layout: str, n: int, k: int, t: int, calls: int = 1000, profile: bool = False) -> tuple[float, float]:
    """(host µs, wall µs) per `linear_step` call: weights [n, k] bf16, activations [t, k] / [t, n] bf16."""
    w = torch.randn(n, k, device="cuda").to(torch.bfloat16)
    x = torch.randn(t, k, device="cuda").to(torch.bfloat16)
    dy = torch.randn(t, n, device="cuda").to(torch.bfloat16)
    state = forge_dsl.init_state("adamw", w, layout=layout)
    for step in range(1, 20):  # compile, caches
        launch.linear_step("adamw", x, dy, w, state, step=step, **HYPERS)
    torch.cuda.synchronize()
    profiler = cProfile.Profile() if profile else None
    if profiler:
        profiler.enable()
    start = time.perf_counter()
    for step in range(20, 20 + calls):
        launch.linear_step("adamw", x, dy, w, state, step=step, **HYPERS)
    issued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    if profiler:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(22)
    return 1e6 * (issued - start) / calls, 1e6 * (done - start) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", action="store_true", help="cProfile bf16 state, 1024×4096, 16 tokens")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| state | W | T | host µs/call | wall µs/call |\n|---|---|---|---|---|")
    for layout, n, k, t in CASES:
        host, wall = time_calls(layout, n, k, t)
        print(f"| {layout} | {n}×{k} | {t} | {host:.1f} | {wall:.1f} |")
    if args.profile:
        time_calls("bf16", 1024, 4096, 16, profile=True)


if __name__ == "__main__":
    main()
