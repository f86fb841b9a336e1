"""`forge-bench kernel`: one linear layer's weight update, four ways, against the roofline floor.

For W = N × K (bf16 scratch weights, never a user's), T tokens, each spec and
state layout (bf16, fp32, int8, int4), median ms of:

    fused     our tile-fused kernel: dW = dYᵀX accumulated per tile in registers, never stored
    dW+ours   cuBLAS dW (torch.matmul, bf16) + our generated element-wise step kernel
    dW+torch  cuBLAS dW + torch's own step: fused=True where torch has it (AdamW, SGD, Adagrad),
              foreach=True otherwise (NAdam, RAdam, RMSprop); Lion has none.  torch keeps its
              state in the parameter's dtype, so this pair always runs with bf16 state; it is
              measured once per (spec, shape, T) and repeated in every layout's row.
    slab      `kernels.slab_linear_step`: cuBLAS dW for 16 MiB slabs of rows (they stay in L2),
              each consumed at once by our step kernel; the whole dW never exists.
    floor     max(2·T·N·K / 790 TFLOP/s, bytes / 4.3 TB/s), bytes = X and dY read once, W and
              every state tensor (int8 scales included) read and written once, in storage sizes.

Every call rotates among several copies of (x, dy, W, state) whose total size is
at least twice the L2 (60 MB on an H200; W and state are updated in place, so they are
copied too); `triton.testing.do_bench` also flushes L2 before each call.
`--timing graph` times GPU work only: each method replayed from a CUDA graph of 20 calls,
so a busy or slow host (launch costs) cannot show in the numbers; torch's step runs with
`capturable=True` there.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

import forge_dsl
from forge_dsl import kernels
from forge_dsl.kernels import TileConfig
from forge_dsl.kernels.policy import default_slab_bytes, fused_config, slab_rows
from forge_dsl.kernels.layouts import QUANTIZED_NAMES

from .common import Progress, Results, UsageError, format_table, free_memory, graph_ms, median_ms

PEAK_FLOPS = 790e12  # dense bf16 GEMM on these H200s (docs/PERF.md)
PEAK_BYTES_PER_S = 4.3e12  # device-to-device copy on these H200s
LAYOUTS = ("bf16", "fp32", "int8", "int4")
STEP = 10  # a step past RAdam's un-rectified start, so every spec runs its steady-state update
MAX_SETS = 8
DEFAULT_L2_BYTES = 60 * 2**20  # what torch reported for these H200s (KINDS.md)


@dataclass(frozen=True)
class Shape:
    """A linear layer's weight W = N (out) × K (in)."""

    name: str
    N: int
    K: int


def _model_shapes(model: str, hidden: int, q_out: int, kv_out: int, ffn: int, vocab: int) -> list[Shape]:
    return [
        Shape(f"{model}.q_o", q_out, hidden) if q_out == hidden else Shape(f"{model}.q", q_out, hidden),
        Shape(f"{model}.k_v", kv_out, hidden),
        Shape(f"{model}.gate_up", ffn, hidden),
        Shape(f"{model}.down", hidden, ffn),
        Shape(f"{model}.lm_head", vocab, hidden),
    ]


SHAPES = [
    # Llama-3.1-8B: hidden 4096, 32 heads × 128 (8 KV heads), FFN 14336, vocabulary 128256
    *_model_shapes("llama3.1-8b", hidden=4096, q_out=4096, kv_out=1024, ffn=14336, vocab=128256),
    # Qwen3-14B: hidden 5120, 40 heads × 128 (8 KV heads), FFN 17408, vocabulary 151936
    *_model_shapes("qwen3-14b", hidden=5120, q_out=5120, kv_out=1024, ffn=17408, vocab=151936),
]

# torch's own step for each built-in spec: the class, and the implementations to try in order (the first
# that runs on bf16 parameters of the device is used; Adagrad's fused=True reached CUDA only in 2026).
# Lion has none in torch.
TORCH_STEPS = {
    "adamw": ("AdamW", ({"fused": True},)),
    "nadam": ("NAdam", ({"foreach": True},)),
    "radam": ("RAdam", ({"foreach": True},)),
    "rmsprop": ("RMSprop", ({"foreach": True},)),
    "adagrad": ("Adagrad", ({"fused": True}, {"foreach": True})),
    "sgd": ("SGD", ({"fused": True},)),
    "sgd_momentum": ("SGD", ({"fused": True},)),
}


def hypers_for(spec_name: str) -> dict:
    """The keywords every method of one spec runs with (the same for ours and torch's)."""
    return {"lr": 1e-4, **({"momentum": 0.9} if spec_name == "sgd_momentum" else {})}


# ---------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------


def add_arguments(ap) -> None:
    ap.add_argument("--specs", help="comma-separated spec names (default: all built-ins; --quick: adamw,lion)")
    ap.add_argument("--shapes", help="comma-separated shape names (e.g. llama3.1-8b.q_o), model prefixes "
                                     "(llama3.1-8b, qwen3-14b) or NxK sizes (default: every shape of both "
                                     "models; --quick: llama3.1-8b.q_o; CPU: 128x128)")
    ap.add_argument("--tokens", help="comma-separated T (default 512,2048,8192; --quick: 512,2048; CPU: 64)")
    ap.add_argument("--layouts", help="comma-separated state layouts of ours: bf16,fp32,int8,int4 "
                                      "(default: all; --quick: bf16)")
    ap.add_argument("--config", type=parse_config, metavar="BT,BN,BK,WARPS,STAGES[,HALVES[,TMA]][,key=value...]",
                    help="tile config of the fused kernel, as TileConfig.parse reads it (default: the kernel's own "
                         "choice)")
    ap.add_argument("--rounding", choices=("stochastic", "nearest"), default="stochastic",
                    help="bf16 weight write-back of ours (default stochastic; nearest shows what Philox costs)")
    ap.add_argument("--rep", type=float, default=50, metavar="MS", help="do_bench repetition time per method (ms)")
    ap.add_argument("--timing", choices=("events", "graph"), default="events",
                    help="events: triton.testing.do_bench, host launch time included (default); graph: GPU time "
                         "only, each method replayed from a CUDA graph of 20 calls (torch's step runs capturable)")


def parse_config(text: str) -> TileConfig:
    """`TileConfig.parse`, with the error in argparse's form."""
    try:
        return TileConfig.parse(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"--config: {err}") from None


def _split(text: Optional[str], default: list[str]) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()] if text else default


def _ints(text: Optional[str], default: list[int], what: str) -> list[int]:
    try:
        return [int(v) for v in _split(text, [str(d) for d in default])]
    except ValueError:
        raise UsageError(f"{what} expects comma-separated integers, got {text!r}") from None


def select_shapes(tokens: list[str]) -> list[Shape]:
    """Shapes by exact name, model prefix or NxK size (an NxK no model has becomes its own shape)."""
    chosen: list[Shape] = []
    for token in tokens:
        matched = [s for s in SHAPES if token in (s.name, f"{s.N}x{s.K}") or s.name.startswith(token + ".")]
        if not matched:
            try:
                n, k = (int(v) for v in token.lower().split("x"))
            except ValueError:
                names = ", ".join(s.name for s in SHAPES)
                raise UsageError(f"unknown shape {token!r}; use NxK or one of: {names}") from None
            matched = [Shape(token, n, k)]
        chosen += [s for s in matched if s not in chosen]
    return chosen


def resolve_settings(args, device: torch.device) -> dict:
    """The grid to run, from the filters, --quick and the device (tiny shapes on the CPU)."""
    cpu = device.type != "cuda"
    specs = _split(args.specs, ["adamw", "lion"] if args.quick else forge_dsl.builtin_names())
    shapes = select_shapes(_split(args.shapes, ["128x128"] if cpu else
                                  (["llama3.1-8b.q_o"] if args.quick else [s.name for s in SHAPES])))
    tokens = _ints(args.tokens, [64] if cpu else ([512, 2048] if args.quick else [512, 2048, 8192]), "--tokens")
    layouts = _split(args.layouts, ["bf16"] if args.quick else list(LAYOUTS))
    unknown = set(layouts) - set(LAYOUTS)
    if unknown:
        raise UsageError(f"unknown layouts {sorted(unknown)}; choose from {', '.join(LAYOUTS)}")
    for name in specs:
        try:
            forge_dsl.load_spec(name)
        except (FileNotFoundError, forge_dsl.SpecError) as err:
            raise UsageError(str(err)) from None
    if args.timing == "graph" and cpu:
        raise UsageError("--timing graph needs a CUDA device (CUDA graphs); the CPU runs the Triton interpreter")
    return {"specs": specs, "shapes": [asdict(s) for s in shapes], "tokens": tokens, "layouts": layouts,
            "config": asdict(args.config) if args.config else "default (per row)", "rep_ms": args.rep, "step": STEP,
            "timing": args.timing, "rounding": args.rounding,
            # the roofline is the H200's: CPU (interpreter) times get none
            "weights": "bf16", "activations": "bf16", "peak_flops": None if cpu else PEAK_FLOPS,
            "peak_bytes_per_s": None if cpu else PEAK_BYTES_PER_S, "l2_bytes": None if cpu else l2_bytes(device)}


# ---------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------


def floor_ms(T: int, N: int, K: int, moved_bytes: int, device: Optional[torch.device] = None) -> dict:
    """Roofline floor of one update on the H200: the larger of the GEMM's compute time and the memory time;
    on the CPU only the bytes (the floor is the H200's, no measure of the interpreter); device None: the H200."""
    if device is not None and device.type != "cuda":
        return {"floor_ms": None, "flop_ms": None, "memory_ms": None, "bytes": moved_bytes}
    flop_ms = 2 * T * N * K / PEAK_FLOPS * 1e3
    memory_ms = moved_bytes / PEAK_BYTES_PER_S * 1e3
    return {"floor_ms": max(flop_ms, memory_ms), "flop_ms": flop_ms, "memory_ms": memory_ms, "bytes": moved_bytes}


def moved_bytes(spec_name: str, shape: Shape, T: int, layout: str) -> int:
    """Bytes one update must move at least: bf16 X and dY read once; bf16 W and every per-element state
    tensor (int8 scales included, 0-dim host scalars not) read and written once, in their storage sizes."""
    meta_w = torch.empty(shape.N, shape.K, device="meta", dtype=torch.bfloat16)
    state = forge_dsl.init_state(spec_name, meta_w, layout=layout, **hypers_for(spec_name))
    state_bytes = sum(t.numel() * t.element_size() for t in state.values() if t.dim() > 0)
    return 2 * T * (shape.N + shape.K) + 2 * (2 * shape.N * shape.K + state_bytes)


def l2_bytes(device: torch.device) -> int:
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", DEFAULT_L2_BYTES)


def n_sets(set_bytes: int, device: torch.device) -> int:
    """How many copies to rotate among so that together they are at least twice the L2 (one on the CPU)."""
    if device is not None and device.type != "cuda":
        return 1
    return max(1, min(MAX_SETS, math.ceil(2 * l2_bytes(device) / set_bytes)))


def make_inputs(T: int, shape: Shape, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(T, shape.K, device=device, dtype=torch.bfloat16)
    dy = torch.randn(T, shape.N, device=device, dtype=torch.bfloat16) * 1e-3
    return x, dy


def scratch_weight(shape: Shape, device: torch.device) -> torch.Tensor:
    return (torch.randn(shape.N, shape.K, device=device) * 0.02).to(torch.bfloat16)


def rotating(sets: list, body: Callable) -> Callable[[], None]:
    """A no-argument call that runs `body(*set)` on the next set each time, after one priming call per set."""
    for s in sets:
        body(*s)  # compiles, creates lazily made state (torch), and warms every copy
    cycle = itertools.cycle(sets)
    return lambda: body(*next(cycle))


def timed(fn_factory: Callable[[], Callable[[], None]], device: torch.device, settings: dict,
          errors: dict, key: str) -> Optional[float]:
    """Median ms of the call `fn_factory()` builds, by `settings["timing"]` ("events": do_bench for
    `settings["rep_ms"]`; "graph": `graph_ms`); on failure (OOM, out of resources, not capturable) None
    and errors[key]."""
    try:
        fn = fn_factory()
        if settings.get("timing") == "graph":
            return graph_ms(fn, device)
        rep_ms = settings["rep_ms"]
        return median_ms(fn, device, warmup_ms=rep_ms / 5, rep_ms=rep_ms)
    except Exception as err:  # a result too: OOM, Triton's out-of-resources for a --config, ...
        errors[key] = "OOM" if isinstance(err, torch.cuda.OutOfMemoryError) else \
            f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        return None


@functools.lru_cache(maxsize=None)
def torch_step(spec_name: str, device_type: str) -> Optional[tuple[str, tuple]]:
    """(class name, implementation keywords as pairs) of torch's step for a spec on this device, or None."""
    if spec_name not in TORCH_STEPS:
        return None
    cls_name, options = TORCH_STEPS[spec_name]
    for keywords in options:
        probe = torch.nn.Parameter(torch.zeros(64, device=device_type, dtype=torch.bfloat16))
        probe.grad = torch.zeros_like(probe)
        try:
            getattr(torch.optim, cls_name)([probe], **hypers_for(spec_name), **keywords).step()
        except (RuntimeError, ValueError, NotImplementedError):  # this implementation is not available here
            continue
        return cls_name, tuple(keywords.items())
    return None


def torch_step_label(choice: Optional[tuple[str, tuple]]) -> Optional[str]:
    """('AdamW', (('fused', True),)) → 'AdamW(fused=True)'."""
    return None if choice is None else f"{choice[0]}({', '.join(f'{k}={v}' for k, v in choice[1])})"


def bench_torch_pair(spec_name: str, shape: Shape, T: int, device: torch.device, settings: dict,
                     errors: dict) -> Optional[float]:
    """cuBLAS dW + torch's own fused/foreach step (bf16 state), or None where torch has no such optimizer.
    With graph timing the step is `capturable=True` (its step count on the GPU), as graph capture needs."""
    choice = torch_step(spec_name, device.type)
    if choice is None:
        return None
    cls = getattr(torch.optim, choice[0])
    keywords = {**hypers_for(spec_name), **dict(choice[1])}
    if settings.get("timing") == "graph":
        keywords["capturable"] = True

    def build():
        count = n_sets(moved_bytes(spec_name, shape, T, "bf16"), device)
        params = [torch.nn.Parameter(scratch_weight(shape, device)) for _ in range(count)]
        sets = [(*make_inputs(T, shape, device), p, cls([p], **keywords)) for p in params]

        def body(x, dy, p, opt):
            p.grad = torch.matmul(dy.t(), x)
            opt.step()

        return rotating(sets, body)

    return timed(build, device, settings, errors, "dw_torch")


def bench_case(spec_name: str, shape: Shape, T: int, layout: str, device: torch.device, settings: dict,
               config: Optional[TileConfig]) -> dict:
    """One row: fused and dW+ours timings with their floor (the torch pair is added by the caller)."""
    spec = forge_dsl.load_spec(spec_name)
    hypers = hypers_for(spec_name)
    rounding = settings["rounding"]
    moved = moved_bytes(spec_name, shape, T, layout)
    count = n_sets(moved, device)
    weights = [scratch_weight(shape, device) for _ in range(count)]
    sets = [(*make_inputs(T, shape, device), w, forge_dsl.init_state(spec, w, layout=layout, **hypers))
            for w in weights]

    def fused(x, dy, w, state):
        kernels.fused_linear_step(spec, x, dy, w, state, step=STEP, config=config, rounding=rounding, **hypers)

    def dw_ours(x, dy, w, state):
        kernels.step(spec, w, torch.matmul(dy.t(), x), state, step=STEP, rounding=rounding, **hypers)

    def slab(x, dy, w, state):
        kernels.slab_linear_step(spec, x, dy, w, state, step=STEP, rounding=rounding, **hypers)

    errors: dict = {}
    quantized = layout in QUANTIZED_NAMES
    row = {"spec": spec_name, "shape": shape.name, "N": shape.N, "K": shape.K, "T": T, "layout": layout,
           "sets": count, "config": asdict(config or fused_config(T, shape.N, shape.K, device, quantized)),
           **floor_ms(T, shape.N, shape.K, moved, device)}
    row["fused_ms"] = timed(lambda: rotating(sets, fused), device, settings, errors, "fused")
    row["dw_ours_ms"] = timed(lambda: rotating(sets, dw_ours), device, settings, errors, "dw_ours")
    # the extra path: cuBLAS dW in L2-sized row slabs, each consumed by our step kernel (never the whole dW)
    row["slab_ms"] = timed(lambda: rotating(sets, slab), device, settings, errors, "slab")
    row["slab_bytes"] = slab_rows(shape.N, shape.K, 2, default_slab_bytes(quantized)) * shape.K * 2  # bf16 dW
    row["errors"] = errors
    return row


def add_ratios(row: dict) -> None:
    """time / floor for each method (None without a floor: CPU runs), and the fused kernel's speedup over
    each unfused pair."""
    for key in ("fused", "dw_ours", "dw_torch", "slab"):
        ms = row.get(f"{key}_ms")
        row[f"{key}_vs_floor"] = ms / row["floor_ms"] if ms and row["floor_ms"] else None
    fused = row["fused_ms"]
    for key in ("dw_ours", "dw_torch", "slab"):
        ms = row.get(f"{key}_ms")
        row[f"fused_speedup_vs_{key}"] = ms / fused if ms and fused else None


def warm_up(device: torch.device, seconds: float = 1.0) -> None:
    """Keep the GPU busy for a moment before the first timing, so that it does not start at idle clocks
    (a precaution: the 2× slow first rows of docs/PERF.md v3 came from a busy host, not from this)."""
    if device is not None and device.type != "cuda":
        return
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize(device)


def run(args, argv: list[str], device: torch.device) -> tuple[Results, str]:
    """Run the grid, writing the JSON after every row and the PNG at the end; the results and the table."""
    settings = resolve_settings(args, device)
    results = Results("kernel", argv, args.out, args.quick, device, settings)
    shapes = [Shape(**s) for s in settings["shapes"]]
    grid = list(itertools.product(shapes, settings["tokens"], settings["specs"]))
    warm_up(device)
    progress = Progress(len(grid) * len(settings["layouts"]))
    for shape, T, spec_name in grid:
        label = f"{spec_name} {shape.N}x{shape.K} T={T}"
        progress.show(f"{label} torch")
        torch_errors: dict = {}
        torch_ms = bench_torch_pair(spec_name, shape, T, device, settings, torch_errors)
        free_memory(device)
        for layout in settings["layouts"]:
            progress.show(f"{label} {layout}")
            row = bench_case(spec_name, shape, T, layout, device, settings, args.config)
            choice = torch_step(spec_name, device.type)
            row.update(dw_torch_ms=torch_ms, torch_step=torch_step_label(choice),
                       torch_state="bf16" if choice else None)
            row["errors"].update(torch_errors)
            add_ratios(row)
            results.add(row)
            free_memory(device)
            progress.advance(label)
    progress.close()
    results.plot(plot)
    return results, table(results.rows)


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------


def table(rows: list[dict]) -> str:
    """Median ms per method, the floor, and the fused kernel's speedup (> 1: fused is faster)."""
    headers = ["spec", "W (N×K)", "T", "state", "fused ms", "dW+ours ms", "dW+torch ms", "slab ms", "floor ms",
               "fused/floor", "dW+torch/floor", "speedup vs dW+ours", "speedup vs dW+torch"]
    body = [[r["spec"], f"{r['N']}×{r['K']}", r["T"], r["layout"], r["fused_ms"], r["dw_ours_ms"],
             r["dw_torch_ms"], r.get("slab_ms"), r["floor_ms"], r["fused_vs_floor"], r["dw_torch_vs_floor"],
             r["fused_speedup_vs_dw_ours"], r["fused_speedup_vs_dw_torch"]] for r in rows]
    return format_table(headers, body)


def plot(plt, results: Results):
    """One panel per spec: time / floor of each method over (shape, T), log scale; on the CPU (no floor)
    the median ms themselves. The figure, drawn with `plt` (matplotlib.pyplot) for `Results.plot`."""
    rows = results.rows
    roofline = any(r.get("floor_ms") for r in rows)
    measure = "vs_floor" if roofline else "ms"
    specs = list(dict.fromkeys(r["spec"] for r in rows))
    cases = list(dict.fromkeys((r["shape"], r["T"]) for r in rows))
    cols = min(2, len(specs))
    n_rows = math.ceil(len(specs) / cols)
    fig, axes = plt.subplots(n_rows, cols, figsize=(7 * cols, 3.4 * n_rows + 0.9), squeeze=False, sharey=True,
                             layout="constrained")
    markers = {"bf16": "o", "fp32": "s", "int8": "^", "int4": "v"}
    for ax, spec_name in zip(axes.flat, specs):
        for r in (r for r in rows if r["spec"] == spec_name):
            x = cases.index((r["shape"], r["T"]))
            for key, color in (("fused", "tab:red"), ("dw_ours", "tab:blue"), ("slab", "tab:green")):
                if r.get(f"{key}_{measure}"):
                    ax.plot(x, r[f"{key}_{measure}"], markers[r["layout"]], color=color, alpha=0.8)
            if r.get(f"dw_torch_{measure}") and r["layout"] == "bf16":
                ax.plot(x, r[f"dw_torch_{measure}"], "D", color="black", alpha=0.8)
        if roofline:
            ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_yscale("log")
        ax.set_title(spec_name)
        ax.set_xticks(range(len(cases)), [f"{s} T={t}" for s, t in cases], rotation=90, fontsize=6)
        ax.set_ylabel("time / roofline floor" if roofline else "median ms (no roofline off the GPU)")
    for ax in list(axes.flat)[len(specs):]:
        ax.axis("off")
    legend = [plt.Line2D([], [], ls="", marker="o", color="tab:red", label="fused"),
              plt.Line2D([], [], ls="", marker="o", color="tab:blue", label="cuBLAS dW + our step"),
              plt.Line2D([], [], ls="", marker="o", color="tab:green", label="cuBLAS dW slabs + our step"),
              plt.Line2D([], [], ls="", marker="D", color="black", label="cuBLAS dW + torch step (bf16 state)")]
    legend += [plt.Line2D([], [], ls="", marker=m, color="gray", label=f"{k} state") for k, m in markers.items()]
    timing = " (GPU time, CUDA graphs)" if results.data["settings"].get("timing") == "graph" else ""
    fig.suptitle(f"one linear layer's update, bf16 weights — {results.data['device']}{timing}", fontsize=10)
    # 7 entries: one row beside two panels, two rows under one (a 7-inch figure cuts a single row off)
    fig.legend(handles=legend, loc="outside lower center", ncol=7 if cols > 1 else 4, fontsize=8)
    return fig
