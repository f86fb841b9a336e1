"""What is allocated at a training step's peak, and by whom: the CUDA caching allocator's trace of one step.

    python bench/memory_peak.py --model llama3.1-8b --seq 8192 --method forge-int8 [--top 30]

Builds the model and method as `forge-bench model` does (activation checkpointing on, its default loss), runs the
warm-up steps, then records one step with `torch.cuda.memory._record_memory_history` (Python frames) and replays
the trace: the allocations alive when the step's allocated bytes peaked, grouped by where they were made (the
innermost frame in transformers, forge_dsl or torch's checkpointing, and the line of the training step that led
there), largest first. Memory allocated before the recorded step (weights, optimizer state) is reported as one
figure. CUDA only.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from forge_dsl.bench import model as bench  # noqa: E402

_OWN = ("transformers/", "forge_dsl/", "torch/utils/checkpoint", "torch/nn/functional", "memory_peak.py")


def where(frames: list) -> str:
    """A short call site: the innermost frames of interest (innermost first), two of them."""
    picked = []
    for f in frames:
        name = f.get("filename", "")
        if any(key in name for key in _OWN):
            picked.append(f"{name.rsplit('/', 1)[-1]}:{f.get('line')} {f.get('name')}")
        if len(picked) == 3:
            break
    return " < ".join(picked) or "?"


def live_at_peak(trace: list) -> tuple[int, list]:
    """Replay allocator events: (the peak of bytes allocated during the trace, the blocks alive then)."""
    live: dict = {}
    total = peak = 0
    at_peak: dict = {}
    for event in trace:
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif action == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
    return peak, list(at_peak.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3.1-8b", choices=list(bench.MODELS))
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--method", default="forge-int8", choices=list(bench.ALL_METHODS))
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    settings = {"loss": "transformers", "forge_head": True, "warmup_steps": args.warmup, "measured_steps": 1}
    method = bench.ALL_METHODS[args.method]
    model = bench.build_model(args.model, device)
    bench.enable_checkpointing(model)
    head = bench.fused_head_applies(model, method, settings, compiled=False)
    loss_name = bench.FUSED_HEAD if head else settings["loss"]
    finish = method.attach(model, head) if method.fused_head else method.attach(model)
    ids = torch.randint(0, model.config.vocab_size, (1, args.seq), device=device)
    for _ in range(args.warmup):
        bench.train_step(model, ids, finish, loss_name)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    bench.train_step(model, ids, finish, loss_name)
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak_stat = torch.cuda.max_memory_allocated()
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    peak, blocks = live_at_peak(trace)
    gib = 1 << 30
    print(f"{args.model} 1x{args.seq} {args.method} ({loss_name} loss): allocated before the step "
          f"{before / gib:.3f} GiB, step peak (allocator) {peak_stat / gib:.3f} GiB, "
          f"peak above the start in the trace {peak / gib:.3f} GiB in {len(blocks)} blocks")
    groups: dict = collections.defaultdict(lambda: [0, 0])
    for b in blocks:
        g = groups[where(b.get("frames", []))]
        g[0] += b["size"]
        g[1] += 1
    print(f"{'GiB':>8} {'blocks':>6}  made at (innermost first)")
    for site, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"{size / gib:8.3f} {count:6d}  {site}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
