"""Where a whole training step's time goes, per method, side by side: every millisecond of the step accounted for.

    python -m forge_dsl.bench.step_anatomy --methods torch-adamw,forge-bf16,forge-int8 --seq 512
        [--checkpointing on] [--compile on] [--steps 3] [--json FILE]

Each method in turn builds the model as `forge-bench model` does (random init, bf16, the same loss and
checkpointing), runs `--warmup` steps, then `--steps` steps under `torch.profiler` (CPU and CUDA activity). The
step is cut into phases, each ended by a `synchronize` so that its kernels run inside it:

    forward    the model's forward and the loss (for FORGE with the fused head: the loss without logits)
    backward   loss.backward(): ΔX, the recomputed checkpointed layers, FORGE's updates inside it
    optimizer  what runs after backward: `optimizer.step()` and `zero_grad` (FORGE: the parameters not fused)

and each phase's wall time is split into the GPU's busy time by kind of kernel (`KINDS`, by kernel name: matrix
products, attention, FORGE's fused updates, torch's optimizer, the loss, copies, the rest) and its idle time
(the wall minus the union of the kernels' intervals: the GPU waiting for the host, launches, the phase's closing
synchronize). Below them: host-side counts per step — the synchronizations the step itself makes (a `.item()` of a
device tensor is one; the phase cuts left out), the kernels launched, and the host
time inside FORGE's fused-layer updates (`record_function` ranges `forge::*`, on only while a profiler runs).

The phase syncs and the profiler stretch a step (the wall here is longer than `forge-bench model`'s): take step
times and ratios from `forge-bench model --rounds 3`, the split from here. `--device cpu` is a smoke run (the
tiny model in the Triton interpreter: every phase is host time).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from ..kernels import reuse
from .common import format_table, free_memory, synchronize
from .model_methods import backward, micro_batches

__all__ = ["KINDS", "PHASES", "Anatomy", "anatomy_table", "kernel_kind", "main", "measure_anatomy", "union_us"]

PHASES = ("forward", "backward", "optimizer")

# kind of kernel: a regular expression on the kernel's name (first match wins), in the table's order
KINDS = (
    ("FORGE fused, warp-specialized", r"^fused_ws$"),
    ("FORGE fused, Triton tiles", r"^fused$"),
    ("FORGE step kernel (slab path, unfused)", r"^step$"),
    ("FORGE rows (embedding, head)", r"^rows_grad$"),
    ("torch optimizer", r"adam|multi_tensor|foreach|_amp_"),
    ("matmul", r"gemm|nvjet|cutlass|xmma|cublas|sm90_|matmul|mm_|splitK|Kernel2"),
    ("attention", r"flash|fmha|attention|sdpa|efficient"),
    ("loss", r"cross_entropy|softmax|nll|log_softmax"),
    ("copy / fill", r"copy|Copy|fill|Fill|memcpy|Memcpy|memset|Memset|cat|Cat"),
    ("elementwise / other", r""),
)
_KIND_RES = tuple((name, re.compile(pattern)) for name, pattern in KINDS)
# what a step's own synchronizations look like on the host (the phase cuts are subtracted)
_SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def kernel_kind(name: str) -> str:
    """The kind (`KINDS`) of a GPU kernel named `name`."""
    for kind, pattern in _KIND_RES:
        if pattern.search(name):
            return kind
    return KINDS[-1][0]


def union_us(intervals: Sequence[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals (µs): the time some kernel ran, overlaps counted once."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


@dataclass
class Anatomy:
    """One method's step, averaged over the profiled steps (ms per step unless named otherwise).

    phase_wall: phase -> wall time; busy: (phase, kind) -> GPU time of that kind of kernel; idle: phase -> wall
    minus the union of the phase's kernel intervals; syncs / items: host synchronizations and `.item()` calls on
    device tensors per step (the phase cuts left out); kernels: kernels launched per step; forge_host_ms: host
    time inside `forge::*` ranges per step, forge_calls their count; step_ms: the unprofiled wall of a step,
    without phase cuts (median of `--steps` steps, timed before the profiled ones)."""

    method: str
    step_ms: float
    phase_wall: dict = field(default_factory=dict)
    busy: dict = field(default_factory=dict)
    count: dict = field(default_factory=dict)  # (phase, kind) -> kernels per step
    idle: dict = field(default_factory=dict)
    syncs: float = 0.0
    kernels: float = 0.0
    forge_host_ms: float = 0.0
    forge_calls: float = 0.0
    launches: dict = field(default_factory=dict)  # how FORGE's layer updates were launched, per step (reuse.COUNTS)

    def as_json(self) -> dict:
        return {"method": self.method, "step_ms": self.step_ms, "phase_wall_ms": self.phase_wall,
                "busy_ms": {f"{p}/{k}": v for (p, k), v in self.busy.items()},
                "kernels": {f"{p}/{k}": v for (p, k), v in self.count.items()}, "idle_ms": self.idle,
                "syncs_per_step": self.syncs, "kernels_per_step": self.kernels,
                "forge_host_ms_per_step": self.forge_host_ms, "forge_calls_per_step": self.forge_calls,
                "launches_per_step": self.launches}


def analyse(events, method: str, steps: int, step_ms: float, device_type: str) -> Anatomy:
    """An `Anatomy` from a profiler's `events()` of `steps` steps whose phases are `record_function` ranges
    named `anatomy::<phase>`."""
    windows = [(e.name.split("::", 1)[1], e.time_range.start, e.time_range.end) for e in events
               if e.name.startswith("anatomy::") and e.device_type == torch.autograd.DeviceType.CPU]
    out = Anatomy(method, step_ms)
    # the GPU's own events: kernels, copies, fills (not the GPU-side copies of the `record_function` ranges)
    kernels = [e for e in events if e.device_type != torch.autograd.DeviceType.CPU and device_type == "cuda"
               and not getattr(e, "is_user_annotation", False) and e.time_range.end > e.time_range.start]
    for phase in PHASES:
        spans = [(s, e) for p, s, e in windows if p == phase]
        wall = sum(e - s for s, e in spans)
        out.phase_wall[phase] = wall / steps / 1e3
        inside = [k for k in kernels if any(s <= k.time_range.start < e for s, e in spans)]
        for kind, _ in KINDS:
            of_kind = [k for k in inside if kernel_kind(k.name) == kind]
            out.busy[(phase, kind)] = sum(k.time_range.end - k.time_range.start for k in of_kind) / steps / 1e3
            out.count[(phase, kind)] = len(of_kind) / steps
        busy = union_us([(k.time_range.start, k.time_range.end) for k in inside])
        out.idle[phase] = (wall - busy) / steps / 1e3
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    cut_syncs = sum(1 for e in cpu if e.name.startswith("anatomy::"))  # each phase ends with one synchronize
    out.syncs = max(0, sum(1 for e in cpu if e.name in _SYNC_EVENTS) - (cut_syncs if device_type == "cuda" else 0)) \
        / steps
    out.kernels = len(kernels) / steps
    forge = [e for e in cpu if e.name.startswith("forge::")]
    out.forge_host_ms = sum(e.time_range.end - e.time_range.start for e in forge) / steps / 1e3
    out.forge_calls = len(forge) / steps
    return out


def measure_anatomy(method_name: str, model_name: str, seq: int, device: torch.device, *, checkpointing: bool,
                    compiled: bool, warmup: int, steps: int) -> Anatomy:
    """Build, warm up, time and profile one method's step (see the module's docstring)."""
    from . import model as bench_model

    settings = {"loss": "transformers", "forge_head": True}
    method = bench_model.ALL_METHODS[method_name]
    model = bench_model.build_model(model_name, device)
    if checkpointing:
        bench_model.enable_checkpointing(model)
    finish, loss_name, runner = bench_model.attach(model, method, settings, compiled)
    try:
        if micro_batches(finish) > 1:
            raise ValueError(f"{method_name} runs {micro_batches(finish)} micro-batches a step, which the anatomy "
                             "cannot cut into one forward and one backward: time it with forge-bench model")
        ids = bench_model.token_ids(model, seq, device)
        loss_fn = bench_model.LOSS_FUNCTIONS[loss_name]
        for _ in range(warmup):
            bench_model.train_step(runner, ids, finish, loss_name)
        times = []
        for _ in range(steps):
            synchronize(device)
            start = time.perf_counter()
            bench_model.train_step(runner, ids, finish, loss_name)
            synchronize(device)
            times.append((time.perf_counter() - start) * 1e3)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        before = reuse.counts()
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(steps):
                _cut_step(runner, ids, finish, loss_fn, device)
        after = reuse.counts()
        out = analyse(prof.events(), method_name, steps, statistics.median(times), device.type)
        out.launches = {k: (after[k] - before.get(k, 0)) / steps for k in after if after[k] != before.get(k, 0)}
        return out
    finally:
        getattr(finish, "close", lambda: None)()
        del model, finish
        free_memory(device)


def _cut_step(model, ids, finish: Callable[[], None], loss_fn, device: torch.device) -> None:
    """One training step whose phases are `anatomy::<phase>` ranges, each ended by a synchronize."""
    with torch.profiler.record_function("anatomy::forward"):
        loss = loss_fn(model, ids)
        synchronize(device)
    with torch.profiler.record_function("anatomy::backward"):
        backward(finish, loss)
        synchronize(device)
    with torch.profiler.record_function("anatomy::optimizer"):
        finish()
        synchronize(device)


def anatomy_table(results: Sequence[Anatomy]) -> str:
    """The phases' rows (wall, then each kind of kernel and the idle time), one column per method, and the
    difference of each method from the first; the rows of a phase add up to its wall."""
    base = results[0]
    headers = ["ms per step", *(a.method for a in results), *(f"{a.method} − {base.method}" for a in results[1:])]
    rows = []

    def row(label: str, get: Callable[[Anatomy], float], digits: str = "{:.2f}",
            count: Optional[Callable[[Anatomy], float]] = None) -> None:
        values = [get(a) for a in results]
        cells = [digits.format(v) + (f" ({count(a):.0f})" if count is not None else "") for v, a in zip(values, results)]
        rows.append([label, *cells, *(f"{v - values[0]:+.2f}" for v in values[1:])])

    row("step (unprofiled, no cuts)", lambda a: a.step_ms)
    row("step (profiled, phases cut)", lambda a: sum(a.phase_wall.values()))
    for phase in PHASES:
        row(f"**{phase}**", lambda a, p=phase: a.phase_wall[p])
        for kind, _ in KINDS:
            if any(a.busy[(phase, kind)] > 0.005 for a in results):
                row(f"  {kind} (kernels)", lambda a, p=phase, k=kind: a.busy[(p, k)],
                    count=lambda a, p=phase, k=kind: a.count[(p, k)])
        row("  GPU idle (host, launches, the cut)", lambda a, p=phase: a.idle[p])
    row("syncs per step (cuts left out)", lambda a: a.syncs, "{:.0f}")
    row("kernels per step", lambda a: a.kernels, "{:.0f}")
    row("FORGE host ms per step (forge:: ranges)", lambda a: a.forge_host_ms)
    row("FORGE host calls per step", lambda a: a.forge_calls, "{:.0f}")
    for how in sorted({k for a in results for k in a.launches}):
        row(f"FORGE layer updates per step: {how}", lambda a, h=how: a.launches.get(h, 0.0), "{:.0f}")
    return format_table(headers, rows)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from . import model as bench_model

    ap = argparse.ArgumentParser(prog="python -m forge_dsl.bench.step_anatomy", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="torch-adamw,forge-bf16,forge-int8",
                    help=f"comma-separated, the first is the baseline; from {', '.join(bench_model.ALL_METHODS)}")
    ap.add_argument("--model", choices=list(bench_model.MODELS), help="default llama3.1-8b (CPU: tiny-llama)")
    ap.add_argument("--seq", type=int, default=512, help="tokens per step, batch 1 (default 512)")
    ap.add_argument("--checkpointing", choices=("on", "off"), default="off")
    ap.add_argument("--compile", choices=("on", "off"), default="off", help="torch.compile(model), default mode")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="timed steps, then as many profiled (default 3)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", metavar="FILE", help="also write the anatomies as JSON")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        from ..interpreter import use_interpreter

        use_interpreter("python -m forge_dsl.bench.step_anatomy --device cpu")
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in names if m not in bench_model.ALL_METHODS]
    if unknown or not names:
        ap.error(f"--methods: unknown {unknown}; choose from {', '.join(bench_model.ALL_METHODS)}")
    if args.warmup < 1 or args.steps < 1:
        ap.error("--warmup and --steps must be at least 1")
    device = torch.device(args.device)
    model_name = args.model or ("llama3.1-8b" if device.type == "cuda" else "tiny-llama")
    results = [measure_anatomy(m, model_name, args.seq, device, checkpointing=args.checkpointing == "on",
                               compiled=args.compile == "on", warmup=args.warmup, steps=args.steps) for m in names]
    print(f"{model_name}, 1 x {args.seq} tokens, checkpointing {args.checkpointing}, compile {args.compile}, "
          f"{args.steps} steps per method; reused launches {'on' if reuse.enabled() else 'off'} "
          f"(supported by this Triton: {reuse.supported()})")
    print(anatomy_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv, "rows": [a.as_json() for a in results]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
