"""Global-norm clipping and gradient accumulation for fused weights, whose gradients are never stored whole.

    ForgeOptimizer(model, spec, max_grad_norm=c)    optimizer.backward(loss) runs backward twice:
        MEASURE   each fused weight's squared gradient norm, summed on the device; nothing updated
        SCALED    each fused weight's update from grad * clip_coefficient(norm, c)
    ForgeOptimizer(model, spec, accumulation_steps=k)
        ACCUMULATE   each backward adds the fused weights' gradients into a buffer per weight
        APPLY        ... and the k-th (without max_grad_norm) updates from buffer + its own gradient there

A fused weight's gradient reaches a pass as blocks of rows: slabs of a Linear's dW (`kernels.slabs.slab_grads`),
tiles of an embedding's rows, vocabulary blocks of the LM head. `GradRows` does the pass's work on each block;
`FusedWeight` (forge_dsl/training/weight.py) opens one per weight and backward and closes it after the last
block. A Linear's or the head's block is dW as autograd rounds it (the activations' dtype: bf16 for a bf16
model), an embedding's the float32 sum its fused backward forms (more exact than torch's, which rounds it to the
weight's dtype). The squared norms, the norm and the coefficient are float32 (torch takes a bf16 gradient's
norm in bf16: for a bf16 model the coefficients differ by up to ~0.4 %, below bf16's resolution of the gradients
they scale); the buffer (`accumulation_dtype="fp32"`, the default) too.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch

from . import data_parallel, tensor_parallel

__all__ = ["ACCUMULATE", "APPLY", "ACCUMULATION_DTYPES", "GradRows", "MEASURE", "SCALED", "UPDATE",
           "check_accumulation", "check_max_grad_norm", "clip_coefficient", "clipped_backward", "leaves",
           "square_sum"]

UPDATE = "update"  # the plain fused update (no clipping, no accumulation)
MEASURE = "measure"
SCALED = "scaled"
ACCUMULATE = "accumulate"
APPLY = "apply"

ACCUMULATION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s: max_norm / (total_norm + 1e-6)


def check_max_grad_norm(value) -> Optional[float]:
    """`max_grad_norm` as ForgeOptimizer takes it: None (no clipping) or a positive finite number."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"max_grad_norm must be a number or None, got {type(value).__name__}")
    if not 0 < value < float("inf"):
        raise ValueError(f"max_grad_norm must be positive and finite (None: no clipping), got {value}")
    return float(value)


def check_accumulation(steps, dtype) -> tuple[int, torch.dtype]:
    """(`accumulation_steps`, the buffer's torch dtype) as ForgeOptimizer takes them: an int >= 1 and a name of
    `ACCUMULATION_DTYPES`."""
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(f"accumulation_steps must be an int, got {type(steps).__name__}")
    if steps < 1:
        raise ValueError(f"accumulation_steps must be at least 1, got {steps}")
    if dtype not in ACCUMULATION_DTYPES:
        raise ValueError(f"accumulation_dtype must be one of {', '.join(map(repr, ACCUMULATION_DTYPES))}, "
                         f"got {dtype!r}")
    return steps, ACCUMULATION_DTYPES[dtype]


def square_sum(t: torch.Tensor) -> torch.Tensor:
    """‖t‖² as a 0-d float32 tensor on t's device (the norm taken in float32, as `clip_grad_norm_` takes a float32
    gradient's); of a DTensor (a sharded gradient), the whole tensor's, reduced across its mesh."""
    norm = torch.linalg.vector_norm(t, dtype=torch.float32)
    if tensor_parallel.is_dtensor(norm):
        norm = norm.full_tensor()
    return norm.square()


def leaves(loss: torch.Tensor) -> list[torch.Tensor]:
    """Every leaf tensor a backward from `loss` accumulates a `.grad` into (its graph's AccumulateGrad nodes): what
    `ForgeOptimizer.backward`'s second pass must not add to a second time."""
    found, seen, stack = [], set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            found.append(variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def clip_coefficient(squares: torch.Tensor, grads: Iterable[torch.Tensor], max_norm: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the total norm, its clip coefficient) of the fused weights' summed squared norms `squares` (0-d float32)
    and the gradients `grads`: sqrt(squares + Σ‖g‖²) and min(1, max_norm / (norm + 1e-6)), both 0-d float32 on
    the device, no host sync. A non-finite norm gives what `clip_grad_norm_(error_if_nonfinite=False)` gives: a
    NaN norm a NaN coefficient (every clipped gradient NaN), an infinite one 0 (inf * 0 = NaN where a gradient is
    infinite, 0 elsewhere)."""
    total = squares.clone()
    sharded = []
    for g in grads:
        if tensor_parallel.is_dtensor(g) and all(p.is_shard() for p in g.placements):
            sharded.append(g)  # FSDP2's sharded gradients: their local squares, then one all-reduce
        else:
            total += square_sum(g).to(total.device)
    if sharded:
        local = torch.zeros((), dtype=torch.float32, device=total.device)
        for g in sharded:
            local += square_sum(tensor_parallel.local(g)).to(local.device)
        torch.distributed.all_reduce(local, group=sharded[0].device_mesh.get_group())
        total += local
    norm = total.sqrt()
    return norm, torch.clamp(max_norm / (norm + CLIP_EPS), max=1.0)


def clipped_backward(loss: torch.Tensor, progresses: Sequence, params: Sequence[torch.Tensor],
                     max_norm: float) -> torch.Tensor:
    """`ForgeOptimizer.backward`'s two passes from `loss` for the optimizers whose steps' `progresses`
    (`weight.StepProgress`, one per optimizer: several for a `training.mixed` optimizer, clipped by their
    parameters' one global norm) hold `params`; returns the total norm (0-d float32, on the device) and leaves
    (norm, coefficient) in each progress's `clip` for `step()`, which scales the `.grad`s it steps by it.

    MEASURE (`retain_graph=True`): each fused weight's squared gradient norm, summed on the device, and the other
    parameters' `.grad`s; nothing updated. SCALED: each fused weight's update from its gradient times the
    coefficient. Every leaf the first pass gave a `.grad` (the parameters, an input with requires_grad, another
    optimizer's parameter) keeps that one: the second pass adds nothing to it. A fused weight's `.grad` that holds
    no gradient (`data_parallel.is_placeholder`) is neither measured nor kept."""
    is_placeholder = data_parallel.is_placeholder
    if any(p.clip is not None or any(h.updated for h in p.weights.values()) for p in progresses):
        raise RuntimeError("optimizer.backward(loss) ran a second time before optimizer.step(): this step's "
                           "clipped update was already applied. For gradient accumulation over k micro-batches "
                           "construct the optimizer with accumulation_steps=k (and call loss.backward() for "
                           "each), or call optimizer.step() after every backward.")
    for progress in progresses:
        progress.grad_pass = MEASURE
    try:
        loss.backward(retain_graph=True)
    except BaseException:
        for progress in progresses:
            progress.end_pass()
            progress.forget_forwards()  # the batch runs again from its forward
        raise
    measured = [progress.squares for progress in progresses if progress.squares is not None]
    squares = measured[0] if measured else torch.zeros((), dtype=torch.float32, device=loss.device)
    for more in measured[1:]:  # none measured: every fused weight shared or unused in this forward
        squares = squares + more.to(squares.device)
    grads = [p.grad for p in params if p.grad is not None and not is_placeholder(p.grad)]
    norm, coefficient = clip_coefficient(squares, grads, max_norm)
    kept = {t: t.grad for t in [*leaves(loss), *params] if t.grad is not None and not is_placeholder(t.grad)}
    for t in kept:
        t.grad = None
    for progress in progresses:
        progress.grad_pass, progress.grad_scale = SCALED, coefficient
    try:
        loss.backward()
    finally:
        for progress in progresses:
            progress.end_pass()
        for t, g in kept.items():  # the first pass's: step() scales the optimizer's by the coefficient
            t.grad = g
    for progress in progresses:
        progress.clip = (norm, coefficient)
    return norm


class GradRows:
    """One fused weight's gradient in one backward of a pass other than UPDATE, block by block.

    mode: MEASURE (`squares` += ‖block‖²), SCALED (the update from block * `scale`), ACCUMULATE (`buffer` rows +=
    block), APPLY (`buffer` rows += block, then the update from those rows). `update` is the step's
    `kernels.ParamUpdate` (SCALED, APPLY), `buffer` the weight's accumulation buffer [N, K] (ACCUMULATE, APPLY),
    `scale` the clip coefficient (0-d float32, SCALED)."""

    def __init__(self, mode: str, *, update=None, buffer: Optional[torch.Tensor] = None,
                 scale: Optional[torch.Tensor] = None, device: Optional[torch.device] = None) -> None:
        self.mode = mode
        self.update = update
        self.buffer = buffer
        self.scale = scale
        self.squares = torch.zeros((), dtype=torch.float32, device=device) if mode == MEASURE else None

    def add(self, block: torch.Tensor, r0: int) -> None:
        """Rows [r0, r0 + R) of the weight's gradient: block [R, K] (the caller's, written to in place where
        SCALED)."""
        if self.mode == MEASURE:
            self.squares += square_sum(block)
        elif self.mode == SCALED:
            self.update.from_grad(block.mul_(self.scale), rows=r0)
        else:
            rows = self.buffer[r0:r0 + block.shape[0]]
            rows += block
            if self.mode == APPLY:
                self.update.from_grad(rows, rows=r0)
