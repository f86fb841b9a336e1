"""`forge-bench model`: a whole training step of Llama-3.1-8B / Qwen3-14B / Qwen3-32B shapes on one GPU.

Random bf16 weights (built on the meta device, `to_empty` on the GPU, matrices
drawn from N(0, 0.02²), norm weights 1; the real dims are written below, nothing
is downloaded), batch 1 × 512 and 1 × 2048 tokens, activation checkpointing off
and on, AdamW (lr 1e-5, torch defaults otherwise) run by:

    torch-adamw                 torch.optim.AdamW(fused=True); state in the weights' dtype, bf16
    torch-adamw-in-backward     one fused AdamW per parameter, stepped by a post-accumulate-grad hook
                                that then drops the gradient (PyTorch's optimizer-in-backward recipe)
    forge-bf16, forge-int8,     forge_dsl.ForgeOptimizer(model, "adamw", state_dtype=...): every nn.Linear and
    forge-int4                  nn.Embedding weight updated inside backward (no dense gradient); with
                                --forge-head on (the default) also lm_head_loss=True, the loss without logits
    torchao-adamw8bit           torchao.optim.AdamW8bit        (only if torchao is installed)
    bnb-adamw8bit               bitsandbytes.optim.AdamW8bit   (only if bitsandbytes is installed)
    bnb-adamw8bit-in-backward   one bitsandbytes AdamW8bit per parameter, stepped by a post-accumulate-grad
                                hook that then drops the gradient, as torch-adamw-in-backward does
    torch-adamw-clip            torch-adamw after clip_grad_norm_(params, 1.0)  (not in the default list; with
    forge-bf16-clip,            ForgeOptimizer(..., max_grad_norm=1.0) and optimizer.backward(loss): the
    forge-int8-clip             norm's pass, then the clipped update (issue L's measurement))
    torch-adamw-accum2          torch-adamw after 2 micro-batches (forward, backward of loss / 2) summed in .grad;
    forge-bf16-accum2,          ForgeOptimizer(..., accumulation_steps=2) with an fp32 / bf16 buffer: the 2nd
    forge-bf16-accum2-bf16      backward updates (not in the default list; a row's step is both micro-batches)
    torch-muon                  torch.optim.Muon on the blocks' 2-D weights + AdamW(fused) on the rest, from .grad
    forge-muon,                 ForgeOptimizer(model, "muon", model_params=<those>) (momentum fp32 / bf16) +
    forge-muon-bf16             ForgeOptimizer(model, "adamw", model_params=<the rest>, state_dtype="bf16"): every
                                weight updated in backward (issue M's measurement; not in the default list)

With `--offload on`, each forward runs within a `forge_dsl.OffloadActivations`: the checkpointed layers' inputs
(and any other saved tensor of 1 MiB or more) wait for backward in pinned host memory; the table's checkpointing
cell says "on + offload".

The loss is transformers' causal-LM cross-entropy (labels = the ids shifted by
one).  For the FORGE methods with `--forge-head on` (the default) it is
`forge_dsl.training.hf_head`'s loss without logits (`model(input_ids, labels=ids)` of the
model ForgeOptimizer(..., lm_head_loss=True) installed it on; loss column
"fused-head"), where hf_head.install accepts the model and the run is not
compiled (under torch.compile the fused head takes its plain path).  Every other
row computes it by `--loss`:

    transformers  model(input_ids=ids, labels=ids).loss: the [T, vocab] logits upcast to fp32, with the
                  log-softmax and its gradient kept (~3.5 GiB at 2048 × 151936: the step's peak)
    inplace       lean_loss.causal_lm_loss_inplace: the same loss from fp32 chunks of rows, the gradient
                  written into the bf16 logits in the forward (Liger-Kernel's cross-entropy, in PyTorch)

The methods of one configuration run interleaved, `--rounds` times (default 3 on CUDA), rotated so that each
runs first in turn: this GPU's speed drifts 15–20 % between minutes, more than most differences measured here,
so a row's step time is the median of its rounds' medians and its ratio to the configuration's first method is
the median of the per-round ratios, shown with their spread; a ratio holds only where it holds in every round.
Each run starts from an empty allocator with a fresh model, in this process.  After the warm-up
steps: peak memory, the median step time (cuda-synchronized), tokens/s, and the
memory pools, each measured in the run itself:

    weights          the parameters' bytes
    optimizer state  memory still allocated after the warm-up steps (gradients freed) minus what was
                     allocated with the weights alone, before the optimizer was built
    gradients        bytes of the .grad tensors materialized at the end of backward (a fused weight's
                     ConsumedGrad holds none; in-backward methods have dropped theirs)
    activations      bytes the decoder's forward (model.model) saves for backward: every tensor packed by
                     torch.autograd.graph.saved_tensors_hooks during it, one count per storage, parameters
                     left out (with checkpointing: the checkpointed layers' inputs and what lies outside them);
                     with --offload on, what stays on the GPU ("on host": what forge_dsl.OffloadActivations
                     moved to pinned host memory, not part of the peak)
    logits           the loss's own memory: the allocator's peak between the decoder's output and the
                     gradient reaching the logits (or, for the fused head, the decoder's output) in backward,
                     minus what was allocated at the decoder's output: the logits, their fp32 copies and
                     their gradient (the fused head: one vocabulary block of them, and its in-backward update)
    workspace        the peak minus the pools resident at the peak (below): everything else (the decoder's
                     recomputed activations, autograd's transient gradients, cuBLAS and kernel workspaces)

The step is cut into phases at those points (forward: to the decoder's output; loss: to the gradient at the
logits or the hidden states; backward: to the end of loss.backward(); optimizer: the step after it), the
allocator's peak statistic reset at each cut, so the peak is the largest phase peak of the measured steps and
`peak_phase` says where it is.  Resident at a peak in the loss phase: weights, state, activations, logits and
the gradients materialized by then; in the backward or optimizer phase: weights, state and the gradients at
the end of backward (activations and logits are then freed or being freed: what is left of them counts as
workspace); in the forward phase: weights, state and gradients.  The resident pools and the workspace add up
to the peak.  Compiled runs (--compile on) measure no phases, activations or logits: their workspace is the
peak minus weights, state and gradients.  Memory is measured on CUDA only (activations on the CPU too).  An
OOM is a result, recorded as "OOM".
"""

from __future__ import annotations

import importlib.util
import itertools
import statistics
import time
from typing import Callable, Optional

import torch

from ..training.offload import OffloadActivations
from .common import Progress, Results, UsageError, allocated_bytes, free_memory, gib, synchronize
from .lean_loss import causal_lm_loss_inplace
from .model_memory import (PHASES, SavedBytes, StepMemory, instrument, materialized_grad_bytes,
                           resident_at_peak)
from .model_methods import (ALL_METHODS, LR, METHODS, PATH_METHODS, SINGLE_GPU_METHODS, TP_METHODS,
                            Method, backward, micro_batches)
from .model_report import PEAK_POOLS, peak_pools, plot, table
from .parallel import FSDP_METHODS, Parallel, gather_row, init, local_nbytes, shard

# The names of `forge-bench model`, those of its parts (model_methods, model_memory, model_report) included:
# the tests and the tools beside it (model_profile, replot) read them from here.
__all__ = [
    "ALL_METHODS", "FULL_MODELS", "FUSED_HEAD", "LOSSES", "LOSS_FUNCTIONS", "LR", "METHODS", "MODELS", "Method",
    "PATH_METHODS", "PEAK_POOLS", "PHASES", "SINGLE_GPU_METHODS", "SavedBytes", "StepMemory", "TP_METHODS",
    "add_arguments", "attach", "build_model", "enable_checkpointing", "free_memory", "fused_head_applies", "gib",
    "instrument", "is_oom", "materialized_grad_bytes", "measure", "peak_pools", "plot", "resident_at_peak",
    "resolve_settings", "rotated", "run", "run_one", "table", "token_ids", "train_step", "with_ratios", "combine_rounds",
]

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
    # with --tp N only: too large for one H200 with any optimizer state
    "llama3.1-70b": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_parameters=_LLAMA31_ROPE, tie_word_embeddings=False)),
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
    ap.add_argument("--offload", choices=("off", "on", "both"), default="off",
                    help="on: the forward's saved tensors of 1 MiB or more (with checkpointing: the checkpointed "
                         "layers' inputs) kept in pinned host memory by forge_dsl.OffloadActivations, copied on a "
                         "side stream and brought back ahead of their use in backward (default: off)")
    ap.add_argument("--loss", choices=tuple(LOSSES), default="transformers",
                    help="the loss of the non-FORGE methods (and of FORGE with --forge-head off): transformers: "
                         "model(..., labels=ids).loss; inplace: the same loss from fp32 chunks, its gradient "
                         "written into the bf16 logits (default: transformers)")
    ap.add_argument("--forge-head", choices=("on", "off"), default="on",
                    help="on: the FORGE methods compute the loss without logits (ForgeOptimizer(..., "
                         "lm_head_loss=True), loss column 'fused-head') where forge_dsl.training.hf_head accepts the "
                         "model and the run is not compiled; off: they use --loss. Their nn.Embedding weights "
                         "are fused either way (default: on)")
    ap.add_argument("--compile", choices=("off", "on", "both"), default="off",
                    help="run the model under torch.compile (inductor, default mode; the warm-up steps compile "
                         "it); default: off")
    ap.add_argument("--warmup", type=int, default=2, help="steps before measuring (default 2)")
    ap.add_argument("--steps", type=int, default=4, help="measured steps, median taken (default 4)")
    ap.add_argument("--rounds", type=int,
                    help="rounds of each configuration, the methods interleaved (rotated each round so that none "
                         "always runs first), each run with a fresh model; a row reports the median of the rounds' "
                         "medians, every step time, and its ratio to the first method with the rounds' spread "
                         "(default: 3 on CUDA, 1 on the CPU)")
    ap.add_argument("--tp", type=int, default=1, metavar="N",
                    help="shard each model over N GPUs of this host, run under torchrun --nproc-per-node N: "
                         "tensor parallelism, or FSDP2 for the fsdp2-* methods (forge_dsl/bench/parallel.py; default "
                         f"1; default methods with N > 1: {','.join(TP_METHODS)})")
    ap.add_argument("--fsdp", type=int, metavar="N",
                    help="FSDP2 data parallelism over N GPUs of this host, run under torchrun --nproc-per-node N: "
                         f"the fsdp2-* methods alone (default methods: {','.join(FSDP_METHODS)}), each rank its own "
                         "sequence")


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
    tp, fsdp = getattr(args, "tp", 1), getattr(args, "fsdp", None)
    if tp < 1:
        raise UsageError(f"--tp must be at least 1, got {tp}")
    if fsdp is not None:
        if tp != 1:
            raise UsageError("--tp N and --fsdp N both set the ranks a model is sharded over: give one")
        if fsdp < 2:
            raise UsageError(f"--fsdp must be at least 2, got {fsdp}")
        tp = fsdp
    methods = _choose(args.methods, list(FSDP_METHODS) if fsdp else ["torch-adamw", "forge-bf16"] if args.quick else
                      (TP_METHODS if tp > 1 else SINGLE_GPU_METHODS), ALL_METHODS, "methods")
    if tp == 1 and any(m in FSDP_METHODS for m in methods):
        raise UsageError(f"{', '.join(FSDP_METHODS)} shard the model over several GPUs: run them with --fsdp N "
                         "(N > 1) under torchrun")
    if fsdp and any(m not in FSDP_METHODS for m in methods):
        raise UsageError(f"--fsdp {fsdp} runs the FSDP2 methods ({', '.join(FSDP_METHODS)}); "
                         f"{', '.join(m for m in methods if m not in FSDP_METHODS)} run with --tp N or on one GPU")
    try:
        seqs = [int(s) for s in args.seq.split(",")] if args.seq else \
            ([32] if cpu else ([512] if args.quick else [512, 2048]))
    except ValueError:
        raise UsageError(f"--seq expects comma-separated integers, got {args.seq!r}") from None
    rounds = args.rounds if getattr(args, "rounds", None) is not None else (1 if cpu else 3)
    if args.warmup < 1 or args.steps < 1 or rounds < 1:
        raise UsageError("--warmup, --steps and --rounds must be at least 1")
    checkpointing = args.checkpointing or ("off" if args.quick else "both")
    return {"models": models, "methods": methods, "batch": 1, "seq": seqs,
            "checkpointing": [False, True] if checkpointing == "both" else [checkpointing == "on"],
            "offload": [False, True] if args.offload == "both" else [args.offload == "on"],
            "compile": [False, True] if args.compile == "both" else [args.compile == "on"],
            "loss": args.loss, "forge_head": args.forge_head == "on", "warmup_steps": args.warmup,
            "measured_steps": args.steps, "rounds": rounds, "lr": LR, "dtype": "bf16", "tp": tp,
            "ranks_option": "--fsdp" if fsdp else "--tp",
            "dims": {m: MODELS[m][1] for m in models}}


# ---------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------


def build_model(name: str, device: torch.device,
                shard: Optional[Callable[[torch.nn.Module], None]] = None) -> torch.nn.Module:
    """A random-init bf16 causal LM of the named shape, built on meta and materialized on `device`; `shard`
    (forge_dsl.bench.parallel) shards it on meta first, so that only this rank's shard is ever allocated."""
    import transformers

    config_class, dims = MODELS[name]
    config = getattr(transformers, config_class)(**dims)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                              attn_implementation="sdpa")
    if shard is not None:
        shard(model)
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


# the loss of a row: --loss's, or "fused-head": the forward hf_head.install gave the model (labels → loss)
FUSED_HEAD = "fused-head"
LOSS_FUNCTIONS = {**LOSSES, FUSED_HEAD: LOSSES["transformers"]}


def train_step(model, ids: torch.Tensor, finish: Callable[[], None], loss_name: str,
               meter: Optional[StepMemory] = None, offload: Optional[OffloadActivations] = None) -> int:
    """Forward (within `offload` when given) and backward, once per micro-batch of the method (`micro_batches`:
    the loss divided by their number where more than one), then the optimizer; returns the bytes of gradients
    materialized at the end of the last backward. With a `meter`, the step's phases are cut at its start, after
    backward and at its end (the model's hooks from `instrument` cut the rest)."""
    if meter is not None:
        meter.cut("forward")
    passes = micro_batches(finish)
    for _ in range(passes):
        if offload is not None:
            with offload:
                loss = LOSS_FUNCTIONS[loss_name](model, ids)
        else:
            loss = LOSS_FUNCTIONS[loss_name](model, ids)
        backward(finish, loss / passes if passes > 1 else loss)
    grad_bytes = materialized_grad_bytes(model)
    if meter is not None:
        meter.cut("optimizer")
    finish()
    if meter is not None:
        meter.cut(None)
    return grad_bytes


def measure(name: str, method: Method, seq: int, checkpointing: bool, device: torch.device,
            settings: dict, compiled: bool = False, parallel: Optional[Parallel] = None,
            offload: bool = False) -> dict:
    """Build, warm up and time one (model, method, tokens, checkpointing, offload) run; memory in bytes (None off
    CUDA). With `parallel`, the model is sharded over its ranks (forge_dsl.bench.parallel) and this rank's share
    measured; with `offload`, each forward runs within an OffloadActivations."""
    leftover = allocated_bytes(device)  # what an earlier run left behind (should be ~0)
    model = build_model(name, device, shard(method.name, parallel) if parallel is not None else None)
    if checkpointing:
        enable_checkpointing(model)
    weights = sum(local_nbytes(p) for p in model.parameters())
    allocated_with_weights = allocated_bytes(device)
    finish, loss_name, runner = attach(model, method, settings, compiled)
    try:
        # off CUDA (tiny shapes, the interpreter) every saved tensor is moved, for the bookkeeping to run
        offloader = OffloadActivations(device=device.type, **({} if device.type == "cuda" else {"min_bytes": 1})) \
            if offload else None
        grads, persistent, times, meter = _run_steps(runner, finish, seq, device, settings, loss_name,
                                                     instrumented=not compiled, offload=offloader)
    finally:
        getattr(finish, "close", lambda: None)()
    timing = {"params": sum(p.numel() for p in model.parameters()), "step_ms": statistics.median(times),
              "step_ms_all": times, "leftover": leftover, "loss": loss_name,
              "activations": meter.activations if not compiled else None,
              "offloaded": meter.offloaded if not compiled else None}
    if device.type != "cuda":
        return {**timing, **dict.fromkeys(("peak", "weights", "optimizer_state", "gradients", "rest", "logits")),
                "peak_phase": None, "at_peak": None}
    peak = meter.peak
    state = persistent - allocated_with_weights
    at_peak = resident_at_peak(meter, weights, state, leftover or 0)
    return {**timing, "peak": peak, "weights": weights, "optimizer_state": state, "gradients": grads,
            "logits": meter.logits, "rest": peak - weights - state - grads - (leftover or 0),
            "peak_phase": at_peak["phase"] if not compiled else None, "at_peak": at_peak["pools"]}


def attach(model: torch.nn.Module, method: Method, settings: dict, compiled: bool):
    """`method` attached to `model` as every run attaches it: (what runs after each backward, the loss's name in
    LOSS_FUNCTIONS, what to call: `torch.compile(model)` after a dynamo reset where `compiled`, so that each run
    compiles its own graphs, else the model)."""
    head = fused_head_applies(model, method, settings, compiled)
    loss_name = FUSED_HEAD if head else settings["loss"]
    finish = method.attach(model, head) if method.fused_head else method.attach(model)
    if compiled:
        torch._dynamo.reset()
    return finish, loss_name, (torch.compile(model) if compiled else model)


def token_ids(model: torch.nn.Module, seq: int, device: torch.device) -> torch.Tensor:
    """The batch of every run: [1, seq] token ids of the model's vocabulary, drawn from a generator seeded 0."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    vocab = getattr(model, "_orig_mod", model).config.vocab_size
    return torch.randint(0, vocab, (1, seq), generator=gen).to(device)


def fused_head_applies(model: torch.nn.Module, method: Method, settings: dict, compiled: bool) -> bool:
    """Whether this run's method computes the loss without logits: a FORGE method, --forge-head on, not compiled
    (under torch.compile the fused head takes its plain path), and a model hf_head.install accepts."""
    if not (method.fused_head and settings.get("forge_head", False)) or compiled:
        return False
    from ..training import hf_head

    try:
        hf_head.check_installable(model)
    except ValueError:
        return False
    return True


def _run_steps(model, finish, seq: int, device: torch.device, settings: dict, loss_name: str,
               instrumented: bool = True, offload: Optional[OffloadActivations] = None):
    """Warm-up steps, then measured steps, each cut into phases by a StepMemory (each forward within `offload`
    when given): (gradient bytes, memory between steps, step times in ms, the StepMemory of all measured steps:
    each phase's largest peak)."""
    ids = token_ids(model, seq, device)
    grads = 0
    for _ in range(settings["warmup_steps"]):
        grads = train_step(model, ids, finish, loss_name, offload=offload)
    synchronize(device)
    persistent = allocated_bytes(device)  # weights + optimizer state (+ small workspaces): gradients are freed
    meter = StepMemory(device, lambda: materialized_grad_bytes(model))
    active: list = []
    remove = instrument(model, lambda: active[0] if active else None, hook_head=loss_name != FUSED_HEAD,
                        offload=offload) if instrumented else (lambda: None)
    times = []
    try:
        for _ in range(settings["measured_steps"]):
            synchronize(device)
            active[:] = [meter]
            start = time.perf_counter()
            train_step(model, ids, finish, loss_name, meter, offload)
            synchronize(device)
            times.append((time.perf_counter() - start) * 1e3)
            active.clear()
    finally:
        remove()
    return grads, persistent, times, meter


def run_one(name: str, method: Method, seq: int, checkpointing: bool, device: torch.device, settings: dict,
            compiled: bool = False, parallel: Optional[Parallel] = None, offload: bool = False) -> dict:
    """One row; a missing package, an OOM or another failure is a result (the remaining runs still run)."""
    expected_loss = FUSED_HEAD if method.fused_head and settings.get("forge_head") and not compiled \
        else settings["loss"]  # what an OOM or error row would have used (every model here takes the fused head)
    # under FSDP2 every rank trains on its own sequence (data parallelism); under tensor parallelism all on one
    sequences = parallel.world if parallel is not None and method.name in FSDP_METHODS else 1
    row = {"model": name, "method": method.name, "loss": expected_loss, "batch": sequences, "seq": seq,
           "tokens": seq * sequences, "checkpointing": checkpointing, "offload": offload, "compiled": compiled,
           "status": "ok",
           "tp": parallel.world if parallel is not None else 1,
           "sharding": None if parallel is None else ("fsdp2" if sequences > 1 else "tensor-parallel")}
    if method.needs and importlib.util.find_spec(method.needs) is None:
        return {**row, "status": "not installed"}
    try:
        m = measure(name, method, seq, checkpointing, device, settings, compiled, parallel, offload)
    except Exception as err:  # the caller frees memory once the traceback is gone
        if is_oom(err):
            # what was allocated when it failed, and the allocator's own account of what was over
            return {**row, "status": "OOM", "allocated_at_oom_gib": gib(allocated_bytes(device)),
                    "oom_message": str(err)[:500]}
        return {**row, "status": f"error: {type(err).__name__}: {str(err)[:300]}"}
    pools = ("peak", "weights", "optimizer_state", "gradients", "logits", "activations", "offloaded", "rest",
             "leftover")
    return {**row, "loss": m["loss"], "params": m["params"], "step_ms": m["step_ms"], "step_ms_all": m["step_ms_all"],
            "tokens_per_s": row["tokens"] / m["step_ms"] * 1e3, **{f"{k}_gib": gib(m[k]) for k in pools},
            "peak_phase": m["peak_phase"],
            "at_peak_gib": None if m["at_peak"] is None else {k: gib(v) for k, v in m["at_peak"].items()}}


def is_oom(err: BaseException) -> bool:
    """An allocation failure, also when it surfaces as a plain RuntimeError (cuBLAS workspace)."""
    text = str(err)
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in text.lower() or \
        "CUBLAS_STATUS_ALLOC_FAILED" in text


def run(args, argv: list[str], device: torch.device) -> tuple[Optional[Results], str]:
    """Every (model, tokens, checkpointing, method) in a fresh state; the results and the table (with --tp N,
    on rank 0; the other ranks return (None, ""))."""
    settings = resolve_settings(args, device)
    parallel = None
    if settings["tp"] > 1:
        parallel, device = init(settings["tp"], device, settings.get("ranks_option", "--tp"))
    lead = parallel is None or parallel.rank == 0
    results = Results("model", argv, args.out, args.quick, device, settings) if lead else None
    configs = list(itertools.product(settings["models"], settings["seq"], settings["checkpointing"],
                                     settings.get("offload", [False]), settings.get("compile", [False])))
    methods = settings["methods"]
    rounds = settings.get("rounds", 1)
    progress = Progress(len(configs) * len(methods) * rounds) if lead else None
    for name, seq, ckpt, offload, compiled in configs:
        runs: dict[str, list[dict]] = {m: [] for m in methods}
        for r in range(rounds):
            for method_name in rotated(methods, r):
                label = f"{name} 1x{seq} ckpt {'on' if ckpt else 'off'}{' offload' if offload else ''}" \
                        f"{' compiled' if compiled else ''} {method_name}" + (f" round {r + 1}/{rounds}" if rounds > 1 else "")
                if lead:
                    progress.show(label)
                row = gather_row(run_one(name, ALL_METHODS[method_name], seq, ckpt, device, settings, compiled,
                                         parallel, offload), parallel)
                free_memory(device)
                runs[method_name].append(row)
                if lead:
                    progress.advance(label)
        if lead:
            for row in with_ratios([combine_rounds(runs[m]) for m in methods]):
                results.add(row)
    if not lead:
        return None, ""
    progress.close()
    results.plot(plot)
    return results, table(results.rows)


def rotated(methods: list[str], r: int) -> list[str]:
    """The methods' order in round `r`: rotated by `r`, so that each runs first in turn (A B, B A, A B, ...)."""
    shift = r % len(methods)
    return methods[shift:] + methods[:shift]


def combine_rounds(rows: list[dict]) -> dict:
    """One method's row from its rounds' rows (`run_one`'s): the median of the rounds' median step times, each
    round's median (`step_ms_rounds`) and every step (`step_ms_all`); memory from the first round, the largest
    peak of any round beside it. A round that did not finish makes the row that round's (OOM, error)."""
    failed = [r for r in rows if r["status"] != "ok"]
    if failed:
        return {**failed[0], "rounds": len(rows)}
    medians = [r["step_ms"] for r in rows]
    step_ms = statistics.median(medians)
    peaks = [r["peak_gib"] for r in rows if r.get("peak_gib") is not None]
    return {**rows[0], "rounds": len(rows), "step_ms": step_ms, "step_ms_rounds": medians,
            "step_ms_all": [t for r in rows for t in r["step_ms_all"]], "tokens_per_s": rows[0]["tokens"] / step_ms * 1e3,
            "peak_gib_max": max(peaks) if peaks else None}


def with_ratios(rows: list[dict]) -> list[dict]:
    """`rows` (one configuration's, one per method) with each finished row's step time as a ratio to the first
    row's: `ratio` the median over rounds of the per-round ratios (both methods' medians in the same round),
    `ratio_min` / `ratio_max` their spread, `ratio_to` the first row's method."""
    base = rows[0]
    if base["status"] != "ok":
        return rows
    out = []
    for row in rows:
        if row["status"] != "ok":
            out.append(row)
            continue
        ratios = [m / b for m, b in zip(row["step_ms_rounds"], base["step_ms_rounds"])]
        out.append({**row, "ratio_to": base["method"], "ratio": statistics.median(ratios),
                    "ratio_min": min(ratios), "ratio_max": max(ratios)})
    return out
