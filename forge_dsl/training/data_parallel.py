"""FSDP2 (`torch.distributed.fsdp.fully_shard`): each parameter's shard updated in backward as its gradient lands.

    fully_shard(block) for each block; fully_shard(model)
    opt = ForgeOptimizer(model, "adamw", ...)        # a model with FSDP2 modules
    loss.backward()                                 # each shard updated once FSDP2's reduce-scatter lands its
    opt.step()                                      # gradient, which is then dropped; step() steps the rest

Under data parallelism dW is a partial sum on each rank until FSDP2 reduces it, so no update can be fused into the
GEMM; what can be done is updating each parameter's shard the moment its reduced, sharded gradient exists (FSDP2
sets it in `.grad` and runs the parameter's post-accumulate-grad hook, `ShardUpdates.hook`): the spec's
element-wise kernel on the local shard and its sharded state (`tensor_parallel`: layouts of the whole parameter,
stochastic rounding drawn per shard, `state_dict()` as DTensors for torch.distributed.checkpoint), after which the
gradient is replaced by a placeholder without memory (`consumed_grad`): about one layer's sharded gradient is alive
at a time, not the model's.

* `accumulation_steps=k`: FSDP2 adds each micro-batch's reduced gradient into `.grad`; the k-th backward's hook
  updates from the sum.
* `max_grad_norm=c`: the global norm needs every gradient, so the sharded gradients are kept until `step()`,
  which takes their norm (each shard's squares, all-reduced across the mesh) and steps them clipped: no second
  backward (the sharded gradients are 1/N of the pool).
* Refused when the optimizer is built: FSDP2 on a mesh of more than one dimension (HSDP, FSDP with tensor
  parallelism), and FSDP1 or DDP (`tensor_parallel.data_parallel_refusal`).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import tensor_parallel
from .consumed_grad import Unknown, consumed_grad

__all__ = ["ShardUpdates", "fsdp2_refusal", "fully_sharded", "is_placeholder"]


def fully_sharded(model: torch.nn.Module) -> bool:
    """Whether `model` holds FSDP2 modules (`fully_shard`)."""
    return any(tensor_parallel.is_fsdp2(m) for m in model.modules())


def fsdp2_refusal(model: torch.nn.Module) -> Optional[str]:
    """Why a model with FSDP2 modules cannot have its shards updated in backward, or None."""
    for name, p in model.named_parameters():
        if tensor_parallel.is_dtensor(p) and p.device_mesh.ndim != 1:
            return (f"'{name}' is sharded on a {p.device_mesh.ndim}-dimensional mesh {tuple(p.device_mesh.shape)} "
                    "(HSDP, or FSDP2 with tensor parallelism): FORGE updates FSDP2 shards only on a one-dimensional "
                    "mesh. Build the optimizer with fuse=False (every parameter stepped from .grad in step()), or "
                    "shard over one dimension")
    return None


def is_placeholder(grad: Optional[torch.Tensor]) -> bool:
    """Whether `grad` is a shard's placeholder (a DTensor around a `consumed_grad`) or another `Unknown`."""
    return grad is not None and isinstance(tensor_parallel.local(grad), Unknown)


class ShardUpdates:
    """The post-accumulate-grad hooks that update FSDP2 shards in backward, for one optimizer (module docstring).

    `stepper`: the optimizer's `stepper.ParamStepper`; `params`: its DTensor parameters."""

    def __init__(self, stepper, params) -> None:
        self.stepper = stepper
        self.micro_batches: dict[torch.nn.Parameter, int] = {}
        self.updated: set = set()
        self.handles = [p.register_post_accumulate_grad_hook(self.hook) for p in params]

    def hook(self, p: torch.nn.Parameter) -> None:
        """FSDP2 set `p`'s reduced, sharded gradient: update the shard now, unless the step waits for more."""
        progress = self.stepper.progress
        label = self.stepper.label(p)
        if p in self.updated:
            raise RuntimeError(
                f"{label} received a gradient after FORGE applied this step's update of its shard"
                f"{'' if progress.accumulation_steps == 1 else f' (after {progress.accumulation_steps} micro-batches)'}"
                ": for gradient accumulation over k micro-batches construct the optimizer with accumulation_steps=k, "
                "or with fuse=False; otherwise call optimizer.step() after every backward")
        if progress.max_grad_norm is not None:  # clipped in step(), where every gradient is known
            return
        count = self.micro_batches[p] = self.micro_batches.get(p, 0) + 1
        if count < progress.accumulation_steps:  # FSDP2 adds the next micro-batch's into .grad
            return
        stepper = self.stepper
        stepper._check_first_update(p)
        progress.open_backward()
        group = stepper.group_of[p]
        hypers = stepper.group_hypers(group)
        with torch.no_grad():
            stepper.from_grad(p, tensor_parallel.local_grad(p), stepper.state_for(p, group, hypers), hypers)
            local = tensor_parallel.local(p)
            p.grad = tensor_parallel.DTensor.from_local(consumed_grad(local, stepper.names.get(p, label), kind="shard"),
                                                        p.device_mesh, p.placements, shape=p.shape,
                                                        stride=p.stride(), run_check=False)
        self.updated.add(p)
        self.micro_batches[p] = 0

    def end_step(self) -> None:
        """`step()` closed the step (and stepped the shards whose micro-batches were fewer than k): every shard may
        be updated again, its micro-batches counted from 0."""
        self.updated.clear()
        self.micro_batches.clear()

    def drop_accumulated(self) -> None:
        """`zero_grad()`: the micro-batches counted so far are dropped with their gradients."""
        self.micro_batches.clear()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
