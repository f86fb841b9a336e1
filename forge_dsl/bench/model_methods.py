"""The optimizer setups `forge-bench model` compares (its --help lists them: `forge_dsl.bench.model`'s docstring).

A `Method` is a name and an `attach(model)` that builds the optimizer on the model and returns what runs after
each backward (`loss.backward()`, or the returned callable's `.backward(loss)` where it has one: FORGE's
clipping), with the step's number of micro-batches (`micro_batches`: the *-accum methods run forward and backward
that many times a step); `METHODS` is the default list, `PATH_METHODS` the FORGE variants pinned to one linear
path or with reused launches off, issue L's clipping and accumulation and issue M's Muon, `ALL_METHODS` both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

import forge_dsl

from ..training import tensor_parallel
from .parallel import FSDP_METHODS

__all__ = ["ACCUMULATION_STEPS", "ALL_METHODS", "LR", "MAX_GRAD_NORM", "METHODS", "Method", "PATH_METHODS",
           "SINGLE_GPU_METHODS", "TP_METHODS", "backward", "hidden_matrices", "micro_batches"]

LR = 1e-5
MAX_GRAD_NORM = 1.0  # the *-clip methods' (Hugging Face Trainer's default)
ACCUMULATION_STEPS = 2  # the *-accum2 methods' micro-batches a step


@dataclass(frozen=True)
class Method:
    """An optimizer setup: `attach(model)` returns what to run after `loss.backward()` in every step
    (with an optional `.close()` that undoes the attachment at the end of the run). A method with
    `fused_head` is attached as `attach(model, head)`: head True gives it the loss without logits."""

    name: str
    attach: Callable[..., Callable[[], None]]
    needs: Optional[str] = None  # a package that must be importable
    fused_head: bool = False  # FORGE: can compute the loss without logits (ForgeOptimizer's lm_head_loss)


def _stepper(*optimizers: torch.optim.Optimizer, clip: Optional[list] = None, micro_batches: int = 1) \
        -> Callable[[], None]:
    """Step and zero each optimizer; with `clip` (parameters), `clip_grad_norm_(clip, MAX_GRAD_NORM)` first. A
    ForgeOptimizer with max_grad_norm gives the step its backward (`finish.backward`); `micro_batches` backward
    calls precede each step."""
    def finish():
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(clip, MAX_GRAD_NORM)
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)

    finish.optimizer = optimizers[0]
    finish.micro_batches = micro_batches
    if getattr(optimizers[0], "max_grad_norm", None) is not None:
        finish.backward = optimizers[0].backward
    return finish


def backward(finish: Callable[[], None], loss: torch.Tensor) -> None:
    """A step's backward: the method's own (`finish.backward`, FORGE's clipping), else `loss.backward()`."""
    own = getattr(finish, "backward", None)
    if own is not None:
        own(loss)
    else:
        loss.backward()


def micro_batches(finish: Callable[[], None]) -> int:
    """How many forward and backward passes a step of the method `finish` came from runs before `finish()`."""
    return getattr(finish, "micro_batches", 1)


def _torch_adamw_accum(model):
    """torch AdamW(fused=True) after ACCUMULATION_STEPS backward calls summed into the bf16 .grad: the recipe
    FORGE's accumulation is timed against."""
    return _stepper(torch.optim.AdamW(model.parameters(), lr=LR, fused=True), micro_batches=ACCUMULATION_STEPS)


def _torch_adamw_clip(model):
    """torch AdamW(fused=True) after clip_grad_norm_(MAX_GRAD_NORM): the recipe FORGE's clipping is timed against."""
    params = list(model.parameters())
    return _stepper(torch.optim.AdamW(params, lr=LR, fused=True), clip=params)


def _torch_adamw(model):
    """torch AdamW(fused=True); under tensor parallelism one for the DTensor shards and one for the replicated
    plain parameters (the norms), since a fused launch takes tensors of one kind."""
    params = list(model.parameters())
    sharded = [p for p in params if tensor_parallel.is_dtensor(p)]
    plain = [p for p in params if not tensor_parallel.is_dtensor(p)]
    return _stepper(*(torch.optim.AdamW(g, lr=LR, fused=True) for g in (sharded, plain) if g))


def _in_backward(model, make_optimizer: Callable[[list], torch.optim.Optimizer]):
    """One optimizer per parameter (`make_optimizer([p])`), stepped by a post-accumulate-grad hook that then
    drops the gradient: at most one parameter's gradient is alive at a time after its accumulation."""
    optimizers = {p: make_optimizer([p]) for p in model.parameters()}

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
    finish.optimizers = optimizers
    return finish


def _torch_adamw_in_backward(model):
    return _in_backward(model, lambda params: torch.optim.AdamW(params, lr=LR, fused=True))


def _bnb_adamw8bit_in_backward(model):
    import bitsandbytes

    return _in_backward(model, lambda params: bitsandbytes.optim.AdamW8bit(params, lr=LR))


def _forge(state_dtype: str, linear_path: str = "auto", max_grad_norm: Optional[float] = None,
           accumulation_dtype: Optional[str] = None):
    """FORGE AdamW; with `accumulation_dtype`, ACCUMULATION_STEPS micro-batches a step into a buffer of it."""
    k = ACCUMULATION_STEPS if accumulation_dtype else 1

    def attach(model, head: bool = False):
        return _stepper(forge_dsl.ForgeOptimizer(model, "adamw", state_dtype=state_dtype, lr=LR,
                                                 linear_path=linear_path, lm_head_loss=head,
                                                 max_grad_norm=max_grad_norm, accumulation_steps=k,
                                                 accumulation_dtype=accumulation_dtype or "fp32"),
                        micro_batches=k)

    return attach


def hidden_matrices(model) -> tuple[list, list]:
    """(the transformer blocks' 2-D weights, every other parameter): Muon's share and AdamW's, as Muon's authors
    and torch's docs split a model (embeddings, the head and the norms to AdamW)."""
    hidden, rest = [], []
    for name, p in model.named_parameters():
        (hidden if p.dim() == 2 and ".layers." in f".{name}" else rest).append(p)
    return hidden, rest


def _torch_muon(model):
    """torch.optim.Muon (its defaults but lr) on the hidden matrices, AdamW(fused=True) on the rest: the recipe
    FORGE's Muon is timed against (issue M)."""
    hidden, rest = hidden_matrices(model)
    return _stepper(torch.optim.Muon(hidden, lr=LR), torch.optim.AdamW(rest, lr=LR, fused=True))


def _forge_muon(state_dtype: str):
    """FORGE's muon (momentum in `state_dtype`) on the hidden matrices, FORGE AdamW on the rest: two optimizers
    on one model, every weight updated without its gradient stored."""
    def attach(model, head: bool = False):
        hidden, rest = hidden_matrices(model)
        muon = forge_dsl.ForgeOptimizer(model, "muon", model_params=hidden, state_dtype=state_dtype, lr=LR)
        adamw = forge_dsl.ForgeOptimizer(model, "adamw", model_params=rest, state_dtype="bf16", lr=LR,
                                         lm_head_loss=head)
        finish = _stepper(muon, adamw)
        finish.close = lambda: (muon.detach(), adamw.detach())  # the model's forwards given back
        return finish

    return attach


def _torch_adafactor(model):
    """torch.optim.Adafactor (its defaults but lr) on every parameter, stepping from .grad (issue M)."""
    return _stepper(torch.optim.Adafactor(model.parameters(), lr=LR))


def _forge_adafactor(model, head: bool = False):
    """FORGE's adafactor on every parameter: the Linears fused into backward (the layer's gradient one fp32
    transient while its region runs), the embeddings and vectors from .grad in step()."""
    opt = forge_dsl.ForgeOptimizer(model, "adafactor", lr=LR)
    finish = _stepper(opt)
    finish.close = opt.detach
    return finish


def _forge_checked(state_dtype: str):
    """FORGE with every launch checked (`forge_dsl.kernels.reuse` off): the host path before v14."""
    def attach(model, head: bool = False):
        from forge_dsl.kernels import reuse

        reuse.set_enabled(False)
        finish = _forge(state_dtype)(model, head)
        finish.close = lambda: reuse.set_enabled(None)
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
    Method("forge-bf16", _forge("bf16"), fused_head=True),
    Method("forge-int8", _forge("int8"), fused_head=True),
    Method("forge-int4", _forge("int4"), fused_head=True),
    Method("torchao-adamw8bit", _torchao_adamw8bit, needs="torchao"),
    Method("bnb-adamw8bit", _bnb_adamw8bit, needs="bitsandbytes"),
    Method("bnb-adamw8bit-in-backward", _bnb_adamw8bit_in_backward, needs="bitsandbytes"),
    Method("fsdp2-torch-adamw", _torch_adamw),  # --tp N only: FSDP2 over the N ranks (forge_dsl.bench.parallel)
    # --tp N only: FSDP2 over the N ranks, each shard updated in backward as its gradient lands
    Method("fsdp2-forge-bf16", _forge("bf16")),
    Method("fsdp2-forge-int8", _forge("int8")),
)}
SINGLE_GPU_METHODS = [name for name in METHODS if name not in FSDP_METHODS]
TP_METHODS = ["forge-bf16", "forge-int8", "forge-int4", "torch-adamw", *FSDP_METHODS]
# Not in the default list: FORGE with every linear layer's update on one path, to compare the paths
# that `linear_path="auto"` chooses between; and FORGE without reused launches, to measure them.
PATH_METHODS = {m.name: m for m in (
    # global-norm clipping at MAX_GRAD_NORM (issue L): FORGE's two backward passes against torch's clip_grad_norm_
    Method("torch-adamw-clip", _torch_adamw_clip),
    Method("forge-bf16-clip", _forge("bf16", max_grad_norm=MAX_GRAD_NORM), fused_head=True),
    Method("forge-int8-clip", _forge("int8", max_grad_norm=MAX_GRAD_NORM), fused_head=True),
    # gradient accumulation over ACCUMULATION_STEPS micro-batches (issue L): FORGE's fp32 / bf16 buffer against
    # torch's bf16 .grad sums
    Method("torch-adamw-accum2", _torch_adamw_accum),
    Method("forge-bf16-accum2", _forge("bf16", accumulation_dtype="fp32"), fused_head=True),
    Method("forge-bf16-accum2-bf16", _forge("bf16", accumulation_dtype="bf16"), fused_head=True),
    # Muon on the hidden matrices, AdamW on the rest (issue M): torch.optim's from .grad against FORGE's in backward
    Method("torch-muon", _torch_muon),
    Method("forge-muon", _forge_muon("fp32"), fused_head=True),
    Method("forge-muon-bf16", _forge_muon("bf16"), fused_head=True),
    # Adafactor on every parameter (issue M): torch.optim's from .grad against FORGE's in backward
    Method("torch-adafactor", _torch_adafactor),
    Method("forge-adafactor", _forge_adafactor),
    *(Method(f"forge-{state}-{path}", _forge(state, path), fused_head=True)
      for state in ("bf16", "int8") for path in ("fused", "slab")),
    *(Method(f"forge-{state}-checked", _forge_checked(state), fused_head=True) for state in ("bf16", "int8")),
)}
ALL_METHODS = {**METHODS, **PATH_METHODS}
