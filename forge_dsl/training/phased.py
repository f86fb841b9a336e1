"""A spec that runs in phases (`spec.phases`, e.g. Muon's `orthogonalize`): one parameter's update, phase by
phase, and what such a spec refuses before any weight moves.

    update = PhasedUpdate(spec)                      one per optimizer
    update.transients_for(p)                         p's transients (one set per weight shape)
    update.tile_state(p, state)                      the tile phase's state: p's own and the transients
    update.finish(p, tile_state, cfg, step=..., ...) the barrier on the whole weight, then the post phase
    phased_refusal(spec, ...)                        why a configuration cannot run it, or None
    check_and_unfuse_rows(spec, ...)                 ForgeOptimizer's construction: refuse, or leave the weights
                                                     updated a block of rows at a time (nn.Embedding) to step()

The tile phase is an element-wise spec: the stepper runs it as any spec (fused into the layer's dW tiles in
backward, or from `.grad` in `step()`), with the transients as extra states. The transients of one weight shape
are allocated once (fp32) and reused by every layer of that shape: one layer's alive at a time.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from ..api import state_layout
from ..barriers import run_region
from ..kernels.steps import step as elementwise_step
from ..spec import ir
from ..spec.keywords import StepConfig
from ..spec.phases import plan
from ..spec.variants import iter_names, walk_statements
from . import installer, tensor_parallel

__all__ = ["PhasedUpdate", "check_and_unfuse_rows", "phased_refusal"]


class PhasedUpdate:
    """The phases of one spec (`spec.phases.Plan`) applied to parameters, with the transients' scratch.

    Attributes:
        plan: the spec's phases.
    """

    def __init__(self, spec: ir.Spec) -> None:
        self.plan = plan(spec)
        self._scratch: dict[tuple, dict[str, torch.Tensor]] = {}  # (shape, device) -> transient -> [*shape] fp32

    def transients_for(self, param: torch.Tensor) -> dict[str, torch.Tensor]:
        """The transients of `param`'s shape and device (fp32 scratch shaped like it), made on first use."""
        key = (tuple(param.shape), str(param.device))
        scratch = self._scratch.get(key)
        if scratch is None:
            scratch = self._scratch[key] = {name: torch.zeros(param.shape, dtype=torch.float32, device=param.device)
                                            for name in self.plan.transients}
        return scratch

    def tile_state(self, param: torch.Tensor, state: Mapping[str, Any]) -> dict:
        """`param`'s state with the transients added (`transients_for`)."""
        return {**state, **self.transients_for(param)}

    def tile_keywords(self, param: torch.Tensor, cfg: StepConfig) -> dict:
        """The tile phase's keyword values for `param` (the spec's resolved `cfg`, the weight's shape and dtype)."""
        return self.plan.keywords(self.plan.tile, cfg, param.shape, torch.finfo(param.dtype).eps)

    def finish(self, param: torch.Tensor, tile_state: Mapping[str, Any], cfg: StepConfig, *, step: int, seed: int,
               rounding: str) -> None:
        """After `param`'s tile phase: the region on the whole weight, then the post phase (which writes it). A
        per-tensor value the post phase reads is read back to the host (it takes it as a keyword)."""
        phases = self.plan
        if phases.post is None:
            return
        eps = torch.finfo(param.dtype).eps
        grad, results = run_region(phases, {**tile_state, "param": param}, cfg, step, eps)
        elementwise_step(phases.post, param, grad, dict(tile_state), step=step, seed=seed, rounding=rounding,
                         **phases.keywords(phases.post, cfg, param.shape, eps, results))


def phased_refusal(spec: ir.Spec, params: list[tuple[str, torch.Tensor]], *, state_dtype, max_grad_norm,
                   accumulation_steps: int, lm_head_loss: bool, sharded_dp: bool) -> Optional[str]:
    """Why this optimizer cannot run `spec`'s phases (None: it can). `params` are (name, parameter) pairs."""
    phases = plan(spec)
    what = f"{spec.name} runs in phases (forge-gen --explain)"
    if any(b.func == "orthogonalize" for b in phases.barriers):
        for name, p in params:
            if p.dim() != 2:
                return (f"{spec.name} orthogonalizes each update, so it steps only 2-D parameters (as "
                        f"torch.optim.Muon, which refuses the same), but {name} has size {tuple(p.shape)}: give "
                        f"{spec.name} the matrices (model_params=[...]) and the others to another optimizer (e.g. "
                        "torch.optim.AdamW)")
    per_row = [s.name for s in spec.states if s.extent is not None]
    if per_row:
        for name, p in params:
            if p.dim() > 2:
                return (f"{spec.name} keeps states per row and per column ({', '.join(per_row)}) of a weight seen as a "
                        f"matrix of size(0) rows, but {name} has {p.dim()} dimensions, size {tuple(p.shape)} (torch."
                        "optim.Adafactor factors the last two of them, which these states would not equal): give "
                        f"{spec.name} the matrices and vectors (model_params=[...]) and the others to another "
                        "optimizer")
    if max_grad_norm is not None or accumulation_steps > 1:
        return (f"{what}: max_grad_norm= and accumulation_steps= are not supported with it yet; construct the "
                "optimizer with fuse=False and use torch.nn.utils.clip_grad_norm_ and .grad accumulation")
    if lm_head_loss:
        return f"{what}: lm_head_loss=True is not supported with it yet (its head is updated a block of rows at a time)"
    if sharded_dp or any(tensor_parallel.is_dtensor(p) for _, p in params):
        return (f"{what}: sharded parameters (tensor parallelism, FSDP2) are not supported with it yet: its barrier "
                "reads the whole weight, which a shard does not hold; use fuse=False")
    read = {n.id for stmt in walk_statements(phases.region)
            for n in iter_names(stmt.condition if isinstance(stmt, ir.If) else stmt.value)}
    for state in spec.states:
        code = state_layout(spec, state, state_dtype)
        if state.name in read and code not in ("fp32", "bf16"):
            return (f"{what}: its region reads state '{state.name}' whole, which the {code} layout does not hold "
                    f"as numbers; keep it fp32 or bf16 (state_dtype={{'{state.name}': 'fp32'}})")
    return None


def check_and_unfuse_rows(spec: ir.Spec, params: list, names: Mapping, candidates: dict, **options) -> dict:
    """`ForgeOptimizer`'s check of a spec that runs in phases, before anything is installed: `phased_refusal`
    (raised), then `candidates` (`installer.candidates`) with every nn.Embedding weight left unfused (stepped from
    .grad in step(): its update in backward comes a block of rows at a time, and a barrier needs the whole weight).

    Raises:
        ValueError: `phased_refusal`'s reason.
    """
    labelled = [(f"parameter '{names[p]}'" if p in names else f"parameter {i}", p) for i, p in enumerate(params)]
    refusal = phased_refusal(spec, labelled, **options)
    if refusal is not None:
        raise ValueError(refusal)
    return installer.without_embeddings(candidates, f"an nn.Embedding: {spec.name} runs in phases, so it is stepped "
                                                    "from .grad in step()")
