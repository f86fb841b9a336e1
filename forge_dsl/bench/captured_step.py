"""The whole training step in one CUDA graph against eager steps, interleaved (issue K item 4).

    python -m forge_dsl.bench.captured_step [--model llama3.1-8b] [--seq 512] [--rounds 3] [--steps 5]
        [--methods torch-adamw,torch-adamw-graph,forge-bf16,forge-bf16-graph,forge-int8-graph] [--compile]
        [--checkpointing] [--out FILE]

Each round builds a fresh random-init model for every method in turn (the order rotated each round), takes
`--warmup` steps, then times `--steps` steps, each a Python call with a synchronize after it (host time included).
Methods:
  torch-adamw        torch AdamW(fused=True), eager
  torch-adamw-graph  torch AdamW(fused=True, capturable=True): forward, backward and step() captured in one CUDA
                     graph (torch's whole-network recipe, zero_grad(set_to_none=True) before the capture)
  forge-<s>          ForgeOptimizer AdamW with <s> (bf16, int8) state, eager
  forge-<s>-graph    the same with capturable=True, the step a `forge_dsl.CapturedStep`
With --compile every method runs `torch.compile(model)` (inductor's default mode; its warm-up steps compile), the
graph methods capture the compiled code; with --checkpointing every decoder layer recomputes its forward in
backward (transformers' gradient checkpointing). The table gives each method's median over rounds of the rounds'
medians, its ratio to torch-adamw-graph (the median of the per-round ratios, with their min-max) and the peak
memory of its last round.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

import forge_dsl

from .model import LOSSES, build_model, enable_checkpointing, token_ids

LR = 1e-5
METHODS = ("torch-adamw", "torch-adamw-graph", "forge-bf16", "forge-bf16-graph", "forge-int8", "forge-int8-graph")


def _step_fn(model, method: str, ids: torch.Tensor, loss_fn):
    """A callable that runs one training step of `method` on `model` with the batch `ids`."""
    graph = method.endswith("-graph")
    if method.startswith("torch-adamw"):
        opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True, capturable=graph)
        if not graph:
            def eager():
                loss = loss_fn(model, ids)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                return loss
            return eager
        return _torch_graphed(model, opt, ids, loss_fn)
    state = method.split("-")[1]
    opt = forge_dsl.ForgeOptimizer(model, "adamw", lr=LR, state_dtype=state, capturable=graph)
    if not graph:
        def eager():
            loss = loss_fn(model, ids)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
        return eager

    def forward_backward():
        loss = loss_fn(model, ids)
        loss.backward()
        return loss
    return forge_dsl.CapturedStep(opt, forward_backward)


def _torch_graphed(model, opt, ids, loss_fn, warmup: int = 2):
    """torch's whole-network capture recipe: warm-up steps on a side stream, then forward, backward and step() in
    one graph; each later call replays it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            opt.zero_grad(set_to_none=True)
            loss_fn(model, ids).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    opt.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = loss_fn(model, ids)
        loss.backward()
        opt.step()

    def replay():
        graph.replay()
        return loss
    return replay


def run_method(model_name: str, method: str, seq: int, warmup: int, steps: int, loss: str, compiled: bool = False,
               checkpointing: bool = False) -> dict:
    """Build the model, attach `method`, warm up, time `steps` steps: {step_ms (median), step_ms_all, peak_gib}."""
    device = torch.device("cuda")
    torch.cuda.reset_peak_memory_stats()
    model = build_model(model_name, device)
    if checkpointing:
        enable_checkpointing(model)
    ids = token_ids(model, seq, device)
    loss_fn = LOSSES[loss]
    if compiled:
        torch._dynamo.reset()
        runner = torch.compile(model)
        loss_fn = (lambda fn: lambda _model, batch: fn(runner, batch))(loss_fn)
    step = _step_fn(model, method, ids, loss_fn)
    try:
        for _ in range(warmup):
            step()
        torch.cuda.synchronize()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        return {"step_ms": statistics.median(times), "step_ms_all": times,
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    finally:
        del step, model
        gc.collect()
        torch.cuda.empty_cache()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3.1-8b")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=4, help="untimed calls (a graph method's first calls are its "
                                                           "warm-up and capture)")
    ap.add_argument("--loss", choices=sorted(LOSSES), default="transformers")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--compile", action="store_true", help="torch.compile(model) for every method")
    ap.add_argument("--checkpointing", action="store_true", help="gradient checkpointing of the decoder layers")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        ap.error(f"unknown methods {unknown}; known: {', '.join(METHODS)}")
    rounds: dict[str, list] = {m: [] for m in methods}
    errors: dict[str, str] = {}
    for r in range(args.rounds):
        order = methods[r % len(methods):] + methods[:r % len(methods)]
        for method in order:
            if method in errors:
                continue
            try:
                row = run_method(args.model, method, args.seq, args.warmup, args.steps, args.loss, args.compile,
                                 args.checkpointing)
            except Exception as err:  # a method that cannot run here is reported, the others go on
                errors[method] = f"{type(err).__name__}: {err}"[:400]
                print(f"round {r + 1} {method}: {errors[method]}", flush=True)
                gc.collect()
                torch.cuda.empty_cache()
                continue
            rounds[method].append(row)
            print(f"round {r + 1} {method}: {row['step_ms']:.1f} ms, peak {row['peak_gib']:.2f} GiB", flush=True)
    base = "torch-adamw-graph" if rounds.get("torch-adamw-graph") else methods[0]
    print(f"\n{args.model} 1 x {args.seq}{' compiled' if args.compile else ''}"
          f"{' checkpointing' if args.checkpointing else ''}, {args.rounds} rounds of {args.steps} steps; "
          f"ratio to {base} (median of the rounds' ratios, min-max)")
    print("| method | step ms (median of rounds) | ratio | peak GiB |\n|---|---|---|---|")
    table = []
    for method in methods:
        rows = rounds[method]
        if not rows:
            print(f"| {method} | failed: {errors.get(method, '?')[:120]} | | |")
            continue
        ratios = [a["step_ms"] / b["step_ms"] for a, b in zip(rows, rounds[base])]
        med = statistics.median(r["step_ms"] for r in rows)
        print(f"| {method} | {med:.1f} | {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) | "
              f"{rows[-1]['peak_gib']:.2f} |")
        table.append({"method": method, "step_ms": med, "ratio": statistics.median(ratios),
                      "ratio_range": [min(ratios), max(ratios)], "rounds": rows})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"argv": vars(args), "base": base, "rows": table, "errors": errors}, f, indent=1)


if __name__ == "__main__":
    main()
