"""`forge-bench model`: a whole training step of Llama-3.1-8B / Qwen3-14B / Qwen3-32B shapes on one GPU.

Random bf16 weights (built on the meta device, `to_empty` on the GPU, matrices
drawn from N(0, 0.02²), norm weights 1; the real dims are written below, nothing
is downloaded), batch 1 × 512 and 1 × 2048 tokens, activation checkpointing off
and on, AdamW (lr 1e-5, torch defaults otherwise) run by:

    torch-adamw              torch.optim.AdamW(fused=True); state in the weights' dtype, bf16
    torch-adamw-in-backward  one fused AdamW per parameter, stepped by a post-accumulate-grad hook
                             that then drops the gradient (PyTorch's optimizer-in-backward recipe)
    forge-bf16, forge-int8   forge_dsl.ForgeOptimizer(model, "adamw", state_dtype=...)
    torchao-adamw8bit        torchao.optim.AdamW8bit        (only if torchao is installed)
    bnb-adamw8bit            bitsandbytes.optim.AdamW8bit   (only if bitsandbytes is installed)

The loss is transformers' causal-LM cross-entropy (labels = the ids shifted by
one), computed by `--loss`:

    transformers  model(input_ids=ids, labels=ids).loss: the [T, vocab] logits upcast to fp32, with the
                  log-softmax and its gradient kept (~3.5 GiB at 2048 × 151936: the step's peak)
    inplace       lean_loss.causal_lm_loss_inplace: the same loss from fp32 chunks of rows, the gradient
                  written into the bf16 logits in the forward (Liger-Kernel's cross-entropy, in PyTorch)

Each run starts from an empty allocator with a fresh model.  After the warm-up
steps: peak memory (max_memory_allocated over the measured steps), the median
step time (cuda-synchronized), tokens/s and a breakdown of the peak: weights;
optimizer state (memory still allocated after a warm-up step, gradients freed,
minus the weights); gradients still materialized at the end of backward; the
rest (activations, workspace).  An OOM is a result, recorded as "OOM".
"""

from __future__ import annotations

import importlib.util
import itertools
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

import forge_dsl

from ..consumed_grad import ConsumedGrad
from .common import (Progress, Results, UsageError, allocated_bytes, format_table, free_memory, gib,
                     peak_memory_bytes, reset_peak_memory, synchronize)
from .lean_loss import causal_lm_loss_inplace

LR = 1e-5

_LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_QWEN3_ROPE = {"rope_type": "default", "rope_theta": 1000000.0}

# name: (config class, dims), the published configs' dimensions
MODELS = {
    "llama3.1-8b": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_parameters=_LLAMA31_ROPE, tie_word_embeddings=False)),
    "qwen3-14b": ("Qwen3Config", dict(
        vocab_size=151936, hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
        num_attention_heads=40, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_parameters=_QWEN3_ROPE, tie_word_embeddings=False)),
    "qwen3-32b": ("Qwen3Config", dict(
        vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
        num_attention_heads=64, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_parameters=_QWEN3_ROPE, tie_word_embeddings=False)),
    # --quick on a GPU: Llama-3.1-8B's layer and vocabulary, 2 layers
    "llama3.1-8b-2layers": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_parameters=_LLAMA31_ROPE, tie_word_embeddings=False)),
    # the CPU smoke run (Triton interpreter)
    "tiny-llama": ("LlamaConfig", dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False)),
}
FULL_MODELS = ["llama3.1-8b", "qwen3-14b", "qwen3-32b"]

# --loss: name -> loss(model, ids), both transformers' causal-LM loss with the ids as labels
LOSSES = {
    "transformers": lambda model, ids: model(input_ids=ids, labels=ids, use_cache=False).loss,
    "inplace": causal_lm_loss_inplace,
}


@dataclass(frozen=True)
class Method:
    """An optimizer setup: `attach(model)` returns what to run after `loss.backward()` in every step
    (with an optional `.close()` that undoes the attachment at the end of the run)."""

    name: str
    attach: Callable[[torch.nn.Module], Callable[[], None]]
    needs: Optional[str] = None  # a package that must be importable


def _stepper(opt: torch.optim.Optimizer) -> Callable[[], None]:
    def finish():
        opt.step()
        opt.zero_grad(set_to_none=True)

    return finish


def _torch_adamw(model):
    return _stepper(torch.optim.AdamW(model.parameters(), lr=LR, fused=True))


def _torch_adamw_in_backward(model):
    optimizers = {p: torch.optim.AdamW([p], lr=LR, fused=True) for p in model.parameters()}

    def hook(p):
        optimizers[p].step()
        p.grad = None

    handles = [p.register_post_accumulate_grad_hook(hook) for p in optimizers]

    def finish():
        pass

    def close():
        # The hooks live on autograd's C++ side, out of reach of Python's cycle collector: without
        # removing them, the model and its optimizers outlive the run (45 GiB at Llama-3.1-8B).
        for handle in handles:
            handle.remove()
        optimizers.clear()

    finish.close = close
    return finish


def _forge(state_dtype: str, linear_path: str = "auto"):
    return lambda model: _stepper(forge_dsl.ForgeOptimizer(model, "adamw", state_dtype=state_dtype, lr=LR,
                                                           linear_path=linear_path))


def _forge_checked(state_dtype: str):
    """FORGE with every launch checked (`forge_dsl.kernels.prepared` off): the host path before v14."""
    def attach(model):
        from forge_dsl.kernels import prepared

        prepared.set_enabled(False)
        finish = _forge(state_dtype)(model)
        finish.close = lambda: prepared.set_enabled(None)
        return finish

    return attach


def _torchao_adamw8bit(model):
    from torchao.optim import AdamW8bit

    return _stepper(AdamW8bit(model.parameters(), lr=LR))


def _bnb_adamw8bit(model):
    import bitsandbytes

    return _stepper(bitsandbytes.optim.AdamW8bit(model.parameters(), lr=LR))


METHODS = {m.name: m for m in (
    Method("torch-adamw", _torch_adamw),
    Method("torch-adamw-in-backward", _torch_adamw_in_backward),
    Method("forge-bf16", _forge("bf16")),
    Method("forge-int8", _forge("int8")),
    Method("torchao-adamw8bit", _torchao_adamw8bit, needs="torchao"),
    Method("bnb-adamw8bit", _bnb_adamw8bit, needs="bitsandbytes"),
)}
# Not in the default list: FORGE with every linear layer's update on one path, to compare the paths
# that `linear_path="auto"` chooses between; and FORGE without reused launches, to measure them.
PATH_METHODS = {m.name: m for m in (
    *(Method(f"forge-{state}-{path}", _forge(state, path)) for state in ("bf16", "int8") for path in ("fused", "slab")),
    *(Method(f"forge-{state}-checked", _forge_checked(state)) for state in ("bf16", "int8")),
)}
ALL_METHODS = {**METHODS, **PATH_METHODS}


# ---------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------


def add_arguments(ap) -> None:
    ap.add_argument("--models", help=f"comma-separated, from {', '.join(MODELS)} (default: "
                                     f"{','.join(FULL_MODELS)}; --quick: llama3.1-8b-2layers; CPU: tiny-llama)")
    ap.add_argument("--methods", help=f"comma-separated, from {', '.join(METHODS)} "
                                      f"(default: all; --quick: torch-adamw,forge-bf16), or {', '.join(PATH_METHODS)} "
                                      "(every linear layer on the fused or the slab path)")
    ap.add_argument("--seq", help="comma-separated sequence lengths at batch 1 "
                                  "(default 512,2048; --quick: 512; CPU: 32)")
    ap.add_argument("--checkpointing", choices=("off", "on", "both"),
                    help="activation checkpointing (default: both; --quick: off)")
    ap.add_argument("--loss", choices=tuple(LOSSES), default="transformers",
                    help="transformers: model(..., labels=ids).loss; inplace: the same loss from fp32 chunks, "
                         "its gradient written into the bf16 logits (default: transformers)")
    ap.add_argument("--compile", choices=("off", "on", "both"), default="off",
                    help="run the model under torch.compile (inductor, default mode; the warm-up steps compile "
                         "it); default: off")
    ap.add_argument("--warmup", type=int, default=2, help="steps before measuring (default 2)")
    ap.add_argument("--steps", type=int, default=4, help="measured steps, median taken (default 4)")


def _choose(text: Optional[str], default: list[str], known, what: str) -> list[str]:
    chosen = [v.strip() for v in text.split(",") if v.strip()] if text else default
    unknown = [v for v in chosen if v not in known]
    if unknown:
        raise UsageError(f"unknown {what} {unknown}; choose from {', '.join(known)}")
    return chosen


def resolve_settings(args, device: torch.device) -> dict:
    cpu = device.type != "cuda"
    models = _choose(args.models, ["tiny-llama"] if cpu else
                     (["llama3.1-8b-2layers"] if args.quick else FULL_MODELS), MODELS, "models")
    methods = _choose(args.methods, ["torch-adamw", "forge-bf16"] if args.quick else list(METHODS),
                      ALL_METHODS, "methods")
    try:
        seqs = [int(s) for s in args.seq.split(",")] if args.seq else \
            ([32] if cpu else ([512] if args.quick else [512, 2048]))
    except ValueError:
        raise UsageError(f"--seq expects comma-separated integers, got {args.seq!r}") from None
    if args.warmup < 1 or args.steps < 1:
        raise UsageError("--warmup and --steps must be at least 1")
    checkpointing = args.checkpointing or ("off" if args.quick else "both")
    return {"models": models, "methods": methods, "batch": 1, "seq": seqs,
            "checkpointing": [False, True] if checkpointing == "both" else [checkpointing == "on"],
            "compile": [False, True] if args.compile == "both" else [args.compile == "on"],
            "loss": args.loss, "warmup_steps": args.warmup, "measured_steps": args.steps, "lr": LR, "dtype": "bf16",
            "dims": {m: MODELS[m][1] for m in models}}


# ---------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------


def build_model(name: str, device: torch.device) -> torch.nn.Module:
    """A random-init bf16 causal LM of the named shape, built on meta and materialized on `device`."""
    import transformers

    config_class, dims = MODELS[name]
    config = getattr(transformers, config_class)(**dims)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                              attn_implementation="sdpa")
    model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(std=0.02)
            else:
                p.fill_(1.0)  # norm weights
    rotary = model.model.rotary_emb  # its buffers were left uninitialized by to_empty: rebuild it
    model.model.rotary_emb = type(rotary)(config).to(device)
    return model.train()


def enable_checkpointing(model) -> None:
    """Non-reentrant activation checkpointing of every decoder layer (transformers' name changed in v5)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def train_step(model, ids: torch.Tensor, finish: Callable[[], None], loss_name: str) -> int:
    """Forward, backward, optimizer; returns the bytes of gradients materialized at the end of backward."""
    loss = LOSSES[loss_name](model, ids)
    loss.backward()
    # a fused weight's .grad after its update is a ConsumedGrad, which holds no memory
    grad_bytes = sum(p.grad.nbytes for p in model.parameters()
                     if p.grad is not None and not isinstance(p.grad, ConsumedGrad))
    finish()
    return grad_bytes


def measure(name: str, method: Method, seq: int, checkpointing: bool, device: torch.device,
            settings: dict, compiled: bool = False) -> dict:
    """Build, warm up and time one (model, method, tokens, checkpointing) run; memory in bytes (None off CUDA)."""
    leftover = allocated_bytes(device)  # what an earlier run left behind (should be ~0)
    model = build_model(name, device)
    if checkpointing:
        enable_checkpointing(model)
    weights = sum(p.nbytes for p in model.parameters())
    allocated_with_weights = allocated_bytes(device)
    finish = method.attach(model)
    try:
        if compiled:
            torch._dynamo.reset()  # each run compiles its own graphs
        runner = torch.compile(model) if compiled else model
        grads, persistent, times = _run_steps(runner, finish, seq, device, settings)
    finally:
        getattr(finish, "close", lambda: None)()
    timing = {"params": sum(p.numel() for p in model.parameters()), "step_ms": statistics.median(times),
              "step_ms_all": times, "leftover": leftover}
    if device.type != "cuda":
        return {**timing, **dict.fromkeys(("peak", "weights", "optimizer_state", "gradients", "rest"))}
    peak = peak_memory_bytes(device)
    state = persistent - allocated_with_weights
    return {**timing, "peak": peak, "weights": weights, "optimizer_state": state, "gradients": grads,
            "rest": peak - weights - state - grads - (leftover or 0)}


def _run_steps(model, finish, seq: int, device: torch.device, settings: dict):
    """Warm-up steps, then timed steps from a reset memory peak: (gradient bytes, memory between steps,
    step times in ms)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    vocab = getattr(model, "_orig_mod", model).config.vocab_size
    ids = torch.randint(0, vocab, (1, seq), generator=gen).to(device)
    grads = 0
    for _ in range(settings["warmup_steps"]):
        grads = train_step(model, ids, finish, settings["loss"])
    synchronize(device)
    persistent = allocated_bytes(device)  # weights + optimizer state (+ small workspaces): gradients are freed
    reset_peak_memory(device)
    times = []
    for _ in range(settings["measured_steps"]):
        synchronize(device)
        start = time.perf_counter()
        train_step(model, ids, finish, settings["loss"])
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return grads, persistent, times


def run_one(name: str, method: Method, seq: int, checkpointing: bool, device: torch.device, settings: dict,
            compiled: bool = False) -> dict:
    """One row; a missing package, an OOM or another failure is a result (the remaining runs still run)."""
    row = {"model": name, "method": method.name, "loss": settings["loss"], "batch": 1, "seq": seq, "tokens": seq,
           "checkpointing": checkpointing, "compiled": compiled, "status": "ok"}
    if method.needs and importlib.util.find_spec(method.needs) is None:
        return {**row, "status": "not installed"}
    try:
        m = measure(name, method, seq, checkpointing, device, settings, compiled)
    except Exception as err:  # the caller frees memory once the traceback is gone
        if is_oom(err):
            # what was allocated when it failed, and the allocator's own account of what was over
            return {**row, "status": "OOM", "allocated_at_oom_gib": gib(allocated_bytes(device)),
                    "oom_message": str(err)[:500]}
        return {**row, "status": f"error: {type(err).__name__}: {str(err)[:300]}"}
    return {**row, "params": m["params"], "step_ms": m["step_ms"], "step_ms_all": m["step_ms_all"],
            "tokens_per_s": seq / m["step_ms"] * 1e3,
            **{f"{k}_gib": gib(m[k]) for k in ("peak", "weights", "optimizer_state", "gradients", "rest", "leftover")}}


def is_oom(err: BaseException) -> bool:
    """An allocation failure, also when it surfaces as a plain RuntimeError (cuBLAS workspace)."""
    text = str(err)
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in text.lower() or \
        "CUBLAS_STATUS_ALLOC_FAILED" in text


def run(args, argv: list[str], device: torch.device) -> tuple[Results, str]:
    """Every (model, tokens, checkpointing, method) in a fresh state; the results and the table."""
    settings = resolve_settings(args, device)
    results = Results("model", argv, args.out, args.quick, device, settings)
    grid = list(itertools.product(settings["models"], settings["seq"], settings["checkpointing"],
                                  settings.get("compile", [False]), settings["methods"]))
    progress = Progress(len(grid))
    for name, seq, ckpt, compiled, method_name in grid:
        label = f"{name} 1x{seq} ckpt {'on' if ckpt else 'off'}{' compiled' if compiled else ''} {method_name}"
        progress.show(label)
        results.add(run_one(name, ALL_METHODS[method_name], seq, ckpt, device, settings, compiled))
        free_memory(device)
        progress.advance(label)
    progress.close()
    results.plot(plot)
    return results, table(results.rows)


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------


def table(rows: list[dict]) -> str:
    headers = ["model", "tokens", "ckpt", "compiled", "method", "loss", "status", "peak GiB", "step ms", "tokens/s",
               "weights GiB", "opt state GiB", "grads GiB", "rest GiB"]
    body = [[r["model"], f"1×{r['seq']}", "on" if r["checkpointing"] else "off",
             "yes" if r.get("compiled") else "no", r["method"],
             r.get("loss", "transformers"),  # records from before v3 have no --loss
             r["status"], r.get("peak_gib"), r.get("step_ms"), r.get("tokens_per_s"), r.get("weights_gib"),
             r.get("optimizer_state_gib"), r.get("gradients_gib"), r.get("rest_gib")] for r in rows]
    return format_table(headers, body)


def plot(plt, results: Results):
    """One line per run: peak memory stacked by pool (left) and step time (right), horizontal bars. The
    figure, drawn with `plt` (matplotlib.pyplot) for `Results.plot`."""
    rows = results.rows
    fig, (mem, time_ax) = plt.subplots(1, 2, figsize=(13, 1.5 + 0.22 * len(rows)), sharey=True,
                                       width_ratios=(3, 2), layout="constrained")
    pools = (("weights_gib", "weights"), ("optimizer_state_gib", "optimizer state"),
             ("gradients_gib", "gradients at the end of backward"), ("rest_gib", "activations, workspace"))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for y, r in enumerate(rows):
        if r["status"] != "ok":
            mem.text(0, y, f" {r['status']}", va="center", fontsize=7, color="tab:red")
            continue
        left = 0.0
        for (key, _), color in zip(pools, colors):
            if r[key] is not None:
                mem.barh(y, r[key], left=left, color=color, height=0.7)
                left += r[key]
        time_ax.barh(y, r["step_ms"], color="gray", height=0.7)
    if all(r.get("peak_gib") is None for r in rows):
        mem.text(0.5, 0.5, "memory is measured on CUDA only", transform=mem.transAxes, ha="center")
    labels = [f"{r['model']} 1×{r['seq']} ckpt {'on' if r['checkpointing'] else 'off'} · {r['method']}" for r in rows]
    mem.set_yticks(range(len(rows)), labels, fontsize=7)
    mem.invert_yaxis()
    mem.set_xlabel("peak memory (GiB)")
    # under the panels: inside, the legend covers the bars of the last rows, which reach across the axes
    fig.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colors[:4]], labels=[p[1] for p in pools],
               fontsize=7, loc="outside lower center", ncol=4)
    time_ax.set_xlabel("step time (ms)")
    for ax in (mem, time_ax):
        ax.grid(axis="x", alpha=0.3)
    loss = results.data["settings"].get("loss", "transformers")  # records from before v3 have no --loss
    fig.suptitle(f"training step, bf16 weights, batch 1, {loss} loss — "
                 f"{results.data['device']}", fontsize=9)
    return fig
