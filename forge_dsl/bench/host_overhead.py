"""Host time of one `linear_step` call on a GPU: what a training step pays per layer outside the kernels.

    python -m forge_dsl.bench.host_overhead                # the table below
    python -m forge_dsl.bench.host_overhead --profile      # and cProfile's top functions for one case
    python -m forge_dsl.bench.host_overhead --breakdown    # and the parts of one warp-specialized call, each alone

For AdamW with bf16 and int8 state, on a 1024×4096 layer at 16 and 512 tokens (GPU work far shorter than
the call: the host sets the pace) and a 4096² layer at 2048 tokens, `calls` steps are issued back to back
with one synchronize at the end: "host" is the time to issue them, "wall" until the GPU has done them, both
per call. Where host ≈ wall, the GPU waited for the host. Each case runs twice, side by side: every call
checked (`reuse.set_enabled(False)`), then with launches reused (forge_dsl/kernels/reuse.py, the
default). docs/PERF.md, v9c and v14.
"""

import argparse
import cProfile
import pstats
import time

import torch

import forge_dsl
from forge_dsl.kernels import kernel_calls, reuse, steps

CASES = [("bf16", 1024, 4096, 16), ("bf16", 1024, 4096, 512), ("bf16", 4096, 4096, 2048),
         ("int8", 1024, 4096, 16), ("int8", 1024, 4096, 512), ("int8", 4096, 4096, 2048)]
HYPERS = dict(lr=1e-5, betas=(0.9, 0.999), weight_decay=0.1, seed=1)


def time_calls(layout: str, n: int, k: int, t: int, calls: int = 1000, profile: bool = False,
               reused: bool = True) -> tuple[float, float]:
    """(host µs, wall µs) per `linear_step` call: weights [n, k] bf16, activations [t, k] / [t, n] bf16;
    `reused`: whether launches are reused (reuse.set_enabled)."""
    reuse.set_enabled(reused)
    w = torch.randn(n, k, device="cuda").to(torch.bfloat16)
    x = torch.randn(t, k, device="cuda").to(torch.bfloat16)
    dy = torch.randn(t, n, device="cuda").to(torch.bfloat16)
    state = forge_dsl.init_state("adamw", w, layout=layout)
    for step in range(1, 20):  # compile, caches
        steps.linear_step("adamw", x, dy, w, state, step=step, **HYPERS)
    torch.cuda.synchronize()
    profiler = cProfile.Profile() if profile else None
    if profiler:
        profiler.enable()
    start = time.perf_counter()
    for step in range(20, 20 + calls):
        steps.linear_step("adamw", x, dy, w, state, step=step, **HYPERS)
    issued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    if profiler:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(22)
    return 1e6 * (issued - start) / calls, 1e6 * (done - start) / calls


def breakdown(layout: str = "bf16", n: int = 1024, k: int = 4096, t: int = 512, calls: int = 2000) -> None:
    """Host µs per call of the parts of one warp-specialized `linear_step`, each issued `calls` times alone:
    the whole call; our Python with the launch left out; the two activation descriptors; Triton's
    `JITFunction.run` with those arguments (specialization, cache key, launcher); the compiled kernel's
    launcher alone (what a launch can cost at least from Python); and the whole call with launches reused.
    Uses Triton 3.6's internals."""
    reuse.set_enabled(False)
    w = torch.randn(n, k, device="cuda").to(torch.bfloat16)
    x = torch.randn(t, k, device="cuda").to(torch.bfloat16)
    dy = torch.randn(t, n, device="cuda").to(torch.bfloat16)
    state = forge_dsl.init_state("adamw", w, layout=layout)
    captured = {}
    original = kernel_calls.launch_warp_specialized
    from forge_dsl.kernels import gluon_lib

    def capture(cfg, x2, dy2, *rest):
        fused_ws = gluon_lib.fused_ws
        captured.update(fused_ws=fused_ws, cfg=cfg, x2=x2, dy2=dy2)
        real_run = fused_ws.run

        def run(*args, **kwargs):
            captured.update(args=args, kwargs=kwargs)
            return real_run(*args, **kwargs)

        fused_ws.run = run
        try:
            return original(cfg, x2, dy2, *rest)
        finally:
            del fused_ws.run

    step = iter(range(1, 10**9))
    for _ in range(20):
        steps.linear_step("adamw", x, dy, w, state, step=next(step), **HYPERS)
    kernel_calls.launch_warp_specialized = capture
    try:
        steps.linear_step("adamw", x, dy, w, state, step=next(step), **HYPERS)
    finally:
        kernel_calls.launch_warp_specialized = original
    if "args" not in captured:
        print(f"{layout} {n}×{k} T={t}: not the warp-specialized kernel; no breakdown")
        return
    fused_ws, cfg, x2, dy2 = captured["fused_ws"], captured["cfg"], captured["x2"], captured["dy2"]
    args, kwargs = captured["args"], dict(captured["kwargs"])
    grid = kwargs.pop("grid")
    kwargs.pop("warmup")
    compiled = fused_ws.run(*args, grid=grid, warmup=False, **kwargs)
    device = torch.cuda.current_device()
    binder = fused_ws.device_caches[device][4]
    from triton import knobs
    bound, _, _ = binder(*args, **{**kwargs, "debug": False,
                                   "instrumentation_mode": knobs.compilation.instrumentation_mode})
    bound_values = list(bound.values())
    stream = torch.cuda.current_stream().cuda_stream

    def timed(fn) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        issued = time.perf_counter()
        torch.cuda.synchronize()
        return 1e6 * (issued - start) / calls

    parts = {
        "linear_step, whole": lambda: steps.linear_step("adamw", x, dy, w, state, step=next(step), **HYPERS),
        "linear_step, launch left out": None,
        "two activation descriptors": lambda: (gluon_lib.descriptor(x2, [cfg.block_t, cfg.block_k]),
                                               gluon_lib.descriptor(dy2, [cfg.block_t, cfg.block_n])),
        "JITFunction.run (prebuilt args)": lambda: fused_ws.run(*args, grid=grid, warmup=False, **kwargs),
        "compiled launcher alone": lambda: compiled.run(grid[0], 1, 1, stream, compiled.function,
                                                        compiled.packed_metadata, None, None, None,
                                                        *bound_values),
    }
    print(f"\n{layout} state, {n}×{k}, T={t}, {calls} calls each, host µs per call:")
    for name, fn in parts.items():
        if fn is None:
            kernel_calls.launch_warp_specialized = lambda *a: (None, None, None, None)
            try:
                us = timed(lambda: steps.linear_step("adamw", x, dy, w, state, step=next(step), **HYPERS))
            finally:
                kernel_calls.launch_warp_specialized = original
        else:
            us = timed(fn)
        print(f"  {us:8.1f}  {name}")
    reuse.set_enabled(True)
    for _ in range(3):  # prepare
        steps.linear_step("adamw", x, dy, w, state, step=next(step), **HYPERS)
    us = timed(lambda: steps.linear_step("adamw", x, dy, w, state, step=next(step), **HYPERS))
    print(f"  {us:8.1f}  linear_step, whole, launches reused ({reuse.entries()} prepared)")


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m forge_dsl.bench.host_overhead", description=__doc__.splitlines()[0])
    ap.add_argument("--profile", action="store_true", help="cProfile bf16 state, 1024×4096, 16 tokens")
    ap.add_argument("--breakdown", action="store_true",
                    help="time the parts of a warp-specialized call alone (bf16 and int8 state, 1024×4096, 512 tokens)")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| state | W | T | path | host µs/call, checked | reused | wall µs/call, checked | reused |")
    print("|---|---|---|---|---|---|---|---|")
    for layout, n, k, t in CASES:
        host0, wall0 = time_calls(layout, n, k, t, reused=False)
        host1, wall1 = time_calls(layout, n, k, t, reused=True)
        path = "reused" if reuse.entries() else "checked"
        print(f"| {layout} | {n}×{k} | {t} | {path} | {host0:.1f} | {host1:.1f} | {wall0:.1f} | {wall1:.1f} |")
    if args.profile:
        time_calls("bf16", 1024, 4096, 16, profile=True, reused=False)
        time_calls("bf16", 1024, 4096, 16, profile=True)
    if args.breakdown:
        breakdown("bf16")
        breakdown("int8", t=2048)


if __name__ == "__main__":
    main()
