"""Which weights of a model FORGE fuses, and installing (and removing) the forwards that fuse them.

    forge_dsl.fuse(model)                                   marks a model for an optimizer built from its parameters
    found = candidates(model)                               every parameter, with its module and refusal
    forwards, heads = attach(stepper, params, found, ...)   installs a `FusedForward` on each fusable module
    old = fuse_replacement(stepper, p)                      fuses `p` where it replaced a fused module's weight
    detach(stepper, heads)                                  gives every module back its own forward

A weight is fused when it belongs to an nn.Linear or nn.Embedding that `fusion_refusal` accepts, is used by one
module only, requires grad, and is trained by the optimizer; its module then runs `linear.fused_forward` or
`embedding.fused_embedding_forward` through the handle (`weight.FusedWeight`) of that weight.
"""

from __future__ import annotations

import functools
import weakref
from typing import Callable, Iterable, Optional

import torch

from . import hf_head, tensor_parallel
from .consumed_grad import ConsumedGrad
from .embedding import fused_embedding_forward
from .embedding import fusion_refusal as embedding_refusal
from .linear import fused_forward, linear_refusal
from .weight import FusedForward, FusedWeight, forward_of

__all__ = ["Candidate", "attach", "candidates", "detach", "fuse", "fuse_replacement", "fusion_refusal",
           "head_loss_model", "marked", "overlapping_pair", "restore_all"]


def fusion_refusal(module: torch.nn.Module) -> Optional[str]:
    """Why FORGE does not fuse this module's weight (None: it does, if the weight is trained and not shared):
    `linear.linear_refusal` for an nn.Linear, `embedding.fusion_refusal` for an nn.Embedding."""
    if isinstance(module, torch.nn.Embedding):
        return embedding_refusal(module)
    if not isinstance(module, torch.nn.Linear):
        return "not an nn.Linear or nn.Embedding"
    return linear_refusal(module)


class Candidate:
    """What `candidates` found for one parameter of a model: its name, and for a Linear or Embedding weight its
    module and why it cannot be fused (None: it can). Holds the module and weight weakly."""

    __slots__ = ("weight_ref", "module_ref", "name", "refusal")

    def __init__(self, weight, module, name: str, refusal: Optional[str]) -> None:
        self.weight_ref = weakref.ref(weight)
        self.module_ref = weakref.ref(module) if module is not None else None
        self.name = name
        self.refusal = refusal


def candidates(model: torch.nn.Module) -> dict[int, Candidate]:
    """Every parameter of `model` by id: its name, and for the weight of an nn.Linear or nn.Embedding the module
    and `fusion_refusal`'s reason, or that the weight is shared with another module.

    Raises:
        ValueError: the model is data parallel (`tensor_parallel.data_parallel_refusal`).
    """
    refusal = tensor_parallel.data_parallel_refusal(model)
    if refusal is not None:
        raise ValueError(refusal)
    owners: dict[int, int] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for p in module._parameters.values():
            if p is not None:
                owners[id(p)] = owners.get(id(p), 0) + 1
    found = {id(p): Candidate(p, None, name, None) for name, p in model.named_parameters()}
    for name, module in model.named_modules():
        if not isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) or module.weight is None:
            continue
        w = module.weight
        refusal = fusion_refusal(module)
        if refusal is None and owners.get(id(w), 0) > 1:
            refusal = "shared with another module (e.g. tied embeddings)"
        found[id(w)] = Candidate(w, module, f"{name}.weight" if name else "weight", refusal)
    return found


def without_embeddings(found: dict[int, Candidate], why: str) -> dict[int, Candidate]:
    """`found` (`candidates`) with every fusable nn.Embedding weight left unfused for the reason `why` (it is then
    stepped from .grad in step()): where its update in blocks of rows cannot run."""
    out = dict(found)
    for key, c in found.items():
        module = c.module_ref() if c.module_ref is not None else None
        if isinstance(module, torch.nn.Embedding) and c.refusal is None:
            out[key] = Candidate(c.weight_ref(), module, c.name, why)
    return out


# Parameters of models marked by `fuse`, by id (their tensors compare element-wise, so no WeakKeyDictionary).
_MARKED: dict[int, Candidate] = {}
# The LM head weights (by id) of models marked by `fuse(model, lm_head_loss=True)`: the model, weakly.
_HEAD_LOSS: dict[int, tuple] = {}


def fuse(model: torch.nn.Module, *, lm_head_loss: bool = False) -> torch.nn.Module:
    """Mark `model` so that a `ForgeOptimizer` built from its parameters (torch.optim's convention,
    `ForgeOptimizer(model.parameters(), spec, ...)` or param groups) updates its eligible nn.Linear and
    nn.Embedding weights inside backward. Changes nothing in the model (the optimizer installs the fused
    forwards); returns it.

    lm_head_loss: a Hugging Face causal LM (`forge_dsl.training.hf_head.install`'s models) computes its loss
    without logits once the optimizer exists: `model(..., labels=...)` returns the loss with `logits=None`, and
    its LM head is updated one vocabulary block at a time in backward. Refused here (ValueError) for a
    model it cannot do exactly.

    `ForgeOptimizer(model, spec, ...)` does this itself (`lm_head_loss=` there too)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"fuse expects an nn.Module, got {type(model).__name__}")
    if not isinstance(lm_head_loss, bool):
        raise TypeError(f"lm_head_loss must be a bool, got {type(lm_head_loss).__name__}")
    found = candidates(model)
    if lm_head_loss:
        hf_head.check_installable(model)
    for key, candidate in found.items():
        weight = candidate.weight_ref()
        candidate.weight_ref = weakref.ref(weight, lambda _, key=key: _MARKED.pop(key, None))
        _MARKED[key] = candidate
    if lm_head_loss:
        head = model.lm_head.weight
        _HEAD_LOSS[id(head)] = (weakref.ref(head, lambda _, key=id(head): _HEAD_LOSS.pop(key, None)),
                                weakref.ref(model))
    return model


def marked(p: torch.Tensor) -> Optional[Candidate]:
    """What `fuse` recorded for parameter `p`, or None."""
    candidate = _MARKED.get(id(p))
    return candidate if candidate is not None and candidate.weight_ref() is p else None


def head_loss_model(p: torch.Tensor) -> Optional[torch.nn.Module]:
    """The model `fuse(model, lm_head_loss=True)` marked, whose LM head weight is `p`."""
    entry = _HEAD_LOSS.get(id(p))
    return entry[1]() if entry is not None and entry[0]() is p else None


def _head_sink(stepper_ref, weight: torch.nn.Parameter) -> Optional[FusedWeight]:
    """`hf_head.install`'s sink_for of an optimizer (its stepper, held weakly): the head weight's handle, counted
    as a forward through the head, or None (not fused: autograd's dense dW; under torch.compile the head's loss
    is the plain path)."""
    stepper = stepper_ref()
    handle = stepper.progress.weights.get(weight) if stepper is not None else None
    if handle is None or torch.compiler.is_compiling() or not (torch.is_grad_enabled() and weight.requires_grad):
        return None  # without gradients (an evaluation loss) no backward comes: not a use of this step
    handle.note_forward()
    return handle


def attach(stepper, params: Iterable[torch.nn.Parameter], found: dict[int, Candidate], heads: list,
           unfused_reason: dict) -> tuple[list[FusedForward], list[hf_head.HeadHandle]]:
    """Install a `FusedForward` on every eligible Linear and Embedding whose weight is among `params` (each
    weight's handle goes to `stepper.progress.weights`), and the loss without logits on the causal LMs `heads`.
    A weight whose module refuses fusion gets its reason in `unfused_reason`. Everything is checked before any
    module changes.

    Raises:
        ValueError: a weight on a mesh FORGE does not fuse (`tensor_parallel.mesh_refusal`), or one another
            ForgeOptimizer already fuses.
    """
    params = list(params)
    for p in params:  # refused before any module changes
        candidate = found.get(id(p))
        refusal = tensor_parallel.mesh_refusal(p, candidate.name) if candidate is not None else None
        if refusal is not None and candidate.module_ref is not None and candidate.refusal is None:
            raise ValueError(refusal)
    forwards = []
    for p in params:
        candidate = found.get(id(p))
        module = candidate.module_ref() if candidate is not None and candidate.module_ref is not None else None
        if module is None or module.weight is not p:
            continue
        refusal = fusion_refusal(module) or candidate.refusal  # the module may have changed since fuse()
        if refusal is not None:
            unfused_reason[p] = refusal
            continue
        if not p.requires_grad:
            continue
        other = forward_of(module)
        if other is not None and not other.handle.detached:
            raise ValueError(
                f"'{candidate.name}' is already fused by another ForgeOptimizer; call .detach() on that one first"
            )
        handle = FusedWeight(stepper, module, candidate.name)
        run = fused_embedding_forward if isinstance(module, torch.nn.Embedding) else fused_forward
        forward = FusedForward(module, handle, run)
        module.forward = forward
        forwards.append(forward)
        stepper.progress.weights[p] = handle
    sink_for = functools.partial(_head_sink, weakref.ref(stepper))
    installs = [hf_head.install(model, sink_for) for model in heads]  # checked before: no raise
    return forwards, installs


def fuse_replacement(stepper, p: torch.nn.Parameter) -> Optional[FusedWeight]:
    """Fuse `p` (just added to `stepper`'s optimizer) where it replaced the weight of a fused module
    (`module.weight = nn.Parameter(new)`): the module's installed forward runs a new handle of `p` from now on, and
    the old weight's handle leaves the optimizer's fused weights. Only where `p` is the weight of exactly one of
    them (a weight tied to several modules is stepped from its summed `.grad`), requires grad, and its mesh is
    one FORGE fuses. Returns the old weight's handle, or None (nothing changed: `p` is stepped from `.grad`)."""
    weights = stepper.progress.weights
    holders = [h for h in weights.values() if h.replaced and h.module_ref().weight is p]
    if len(holders) != 1 or not p.requires_grad or tensor_parallel.mesh_refusal(p, holders[0].name) is not None:
        return None
    old = holders[0]
    module = old.module_ref()
    forward = forward_of(module)
    if forward is None or forward.handle is not old:
        return None
    handle = FusedWeight(stepper, module, old.name)
    forward.handle = handle
    del weights[old.weight_ref()]
    weights[p] = handle
    return old


def detach(stepper, head_installs: list) -> None:
    """Give every fused module of `stepper`'s optimizer back the forward it had, and every causal LM of
    `head_installs` its own loss; a fused weight's placeholder `.grad` is cleared."""
    for install in head_installs:
        install.remove()
    head_installs.clear()
    for p, handle in stepper.progress.weights.items():
        module = handle.module_ref()
        forward = forward_of(module) if module is not None else None
        if forward is not None and forward.handle is handle:
            forward.restore()
        if isinstance(p.grad, ConsumedGrad):
            p.grad = None
    stepper.progress.weights.clear()


def restore_all(restores: list[Callable[[], None]]) -> None:
    """Call each of `restores` (the bound `restore` / `remove` of what an optimizer installed): the optimizer's
    finalizer."""
    for restore in restores:
        restore()


def overlapping_pair(params: list) -> Optional[tuple[tuple[int, torch.Tensor], tuple[int, torch.Tensor]]]:
    """Two of `params` (with their indices) whose bytes overlap in memory, or None: each one's span, from its first
    element's address to its last's (its local shard under tensor parallelism), compared on its device."""
    spans = []
    for i, p in enumerate(params):
        t = tensor_parallel.local(p)
        if t.numel() == 0 or t.is_meta:
            continue
        start = t.data_ptr()
        last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
        spans.append((str(t.device), start, start + (last + 1) * t.element_size(), i, p))
    spans.sort(key=lambda span: span[:2])
    reach = None  # the span reaching furthest so far on this device
    for span in spans:
        if reach is not None and reach[0] == span[0] and span[1] < reach[2]:
            return (reach[3], reach[4]), (span[3], span[4])
        if reach is None or reach[0] != span[0] or span[2] > reach[2]:
            reach = span
    return None
