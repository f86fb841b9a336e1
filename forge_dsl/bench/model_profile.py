"""Where a model training step's GPU time goes, per method: CUDA kernel time by kernel name.

    python -m forge_dsl.bench.model_profile --methods forge-int8,forge-bf16,torch-adamw [--model llama3.1-8b] [--seq 2048]

Builds the model as `forge-bench model` does (random init, bf16), runs 3 warm-up steps, then
`--steps` steps under `torch.profiler` (CUDA activity only) and prints, per method, the wall time per
step, the summed kernel time per step and the largest kernels (ms per step, calls per step). The
profiler stretches the wall time of methods that launch more kernels: take step times from
`forge-bench model`, and the kernel time from here (docs/PERF.md v10b). `--host`: cProfile's view of the
same steps instead (the host functions with the most time of their own, and the wall per step without it).
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from . import model as bench_model


def _warmed_up(name: str, model_name: str, seq: int):
    """(model, finish, ids): the model built and attached to method `name` as `forge-bench model` does it, after
    three warm-up steps on a batch of `seq` random tokens."""
    method = bench_model.ALL_METHODS[name]
    model = bench_model.build_model(model_name, torch.device("cuda"))
    finish = method.attach(model)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, seq), generator=gen).cuda()
    for _ in range(3):
        bench_model.train_step(model, ids, finish, "transformers")
    torch.cuda.synchronize()
    return model, finish, ids


def profile_method(name: str, model_name: str, seq: int, steps: int, top: int) -> None:
    model, finish, ids = _warmed_up(name, model_name, seq)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            bench_model.train_step(model, ids, finish, "transformers")
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) / steps * 1e3
    kernel_ms: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    for event in prof.key_averages():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        kernel_ms[event.key[:70]] += event.self_device_time_total / steps / 1e3
        calls[event.key[:70]] += event.count // steps
    print(f"## {name}: wall {wall_ms:.1f} ms/step (profiled), kernels {sum(kernel_ms.values()):.1f} ms/step")
    for key, ms in kernel_ms.most_common(top):
        print(f"  {ms:8.2f} ms  x{calls[key]:5d}  {key}")
    getattr(finish, "close", lambda: None)()
    del model, finish  # before emptying the cache: the optimizer's state goes with them
    torch.cuda.empty_cache()


def host_profile(name: str, model_name: str, seq: int, steps: int, top: int) -> None:
    """cProfile of `steps` training steps: the wall per step without and with the profiler, and the host
    functions that take the most time of their own (where a step's host time goes when the GPU waits)."""
    import cProfile
    import pstats

    model, finish, ids = _warmed_up(name, model_name, seq)
    start = time.perf_counter()
    for _ in range(steps):
        bench_model.train_step(model, ids, finish, "transformers")
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) / steps * 1e3
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        bench_model.train_step(model, ids, finish, "transformers")
    torch.cuda.synchronize()
    profiler.disable()
    print(f"## {name}, {seq} tokens: wall {wall_ms:.1f} ms/step; under cProfile, per {steps} steps:")
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    getattr(finish, "close", lambda: None)()
    del model, finish  # before emptying the cache: the optimizer's state goes with them
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m forge_dsl.bench.model_profile", description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="forge-int8,forge-bf16,torch-adamw",
                    help=f"comma-separated, from {', '.join(bench_model.ALL_METHODS)}")
    ap.add_argument("--model", default="llama3.1-8b", choices=list(bench_model.MODELS))
    ap.add_argument("--seq", type=int, default=2048, help="tokens per step, batch 1 (default 2048)")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps (default 3)")
    ap.add_argument("--top", type=int, default=14, help="kernels listed per method (default 14)")
    ap.add_argument("--host", action="store_true",
                    help="cProfile the host instead: wall per step and the functions with the most own time")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("forge_dsl.bench.model_profile needs a CUDA device")
    for name in args.methods.split(","):
        if name not in bench_model.ALL_METHODS:
            raise SystemExit(f"unknown method {name!r}: expected one of {', '.join(bench_model.ALL_METHODS)}")
        (host_profile if args.host else profile_method)(name, args.model, args.seq, args.steps, args.top)


if __name__ == "__main__":
    main()
