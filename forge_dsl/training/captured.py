"""A whole training step in one CUDA graph: `ForgeOptimizer(..., capturable=True)` and `CapturedStep`.

    opt = forge_dsl.ForgeOptimizer(model, "adamw", lr=3e-4, capturable=True)
    x, y = static_x, static_y                           # the step's inputs: tensors the loop copies into

    def forward_backward():
        loss = loss_fn(model(x), y)
        loss.backward()
        return loss

    step = forge_dsl.CapturedStep(opt, forward_backward)
    for batch, target in data:
        x.copy_(batch); y.copy_(target)
        loss = step()                                    # the forward, backward, FORGE's updates and opt.step()
        scheduler.step()                                 # keywords are read before each step, as in eager

The forward and backward, with FORGE's fused updates inside it, are recorded once into a CUDA graph and replayed
every step. What changes from step to step is never a kernel argument: each fused Linear weight's launch reads
its host values (bias corrections, learning rate, ...) and stochastic-rounding key from its row of the optimizer's
host table (`kernels.host_table`), which `CapturedStep` computes on the host from the param groups as they are at
that call and copies to the device before the replay, in one copy for all the layers. After the replay the fused
weights' step counters move and `optimizer.step()` steps the other parameters (norms, biases, embeddings) from
the gradients the graph wrote, eagerly. A step so replayed writes the bits an eager step writes.

`capturable=True` also makes an eager step stage the table once at its first fused update (one host step for
all the layers). What it cannot capture exactly is refused when the optimizer is built (`capturable_refusal`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..kernels.steps import resolved_hypers
from ..spec.phases import is_phased
from . import installer
from .consumed_grad import ConsumedGrad

__all__ = ["CapturedStep", "capturable_refusal", "check_and_unfuse_rows"]


def capturable_refusal(spec, *, max_grad_norm, accumulation_steps: int, lm_head_loss: bool, sharded: bool,
                       linear_path: str) -> Optional[str]:
    """Why an optimizer of `spec` with these options cannot be built with capturable=True (None: it can)."""
    what = None
    if spec.scalars:
        what = (f"'{spec.name}' keeps scalar state ({', '.join(s.name for s in spec.scalars)}), which its host "
                "program advances every step on the host")
    elif is_phased(spec):
        what = f"'{spec.name}' runs in phases (a function of the whole weight between two kernels)"
    elif max_grad_norm is not None:
        what = "max_grad_norm= computes the clip coefficient between two backward passes"
    elif accumulation_steps > 1:
        what = "accumulation_steps= applies the update in every k-th backward only"
    elif lm_head_loss:
        what = "lm_head_loss=True updates the head in blocks of rows, each with its own rounding key"
    elif sharded:
        what = "a sharded model (DTensor parameters) is stepped from reduced gradients"
    elif linear_path == "slab":
        what = "linear_path=\"slab\" draws a rounding key per slab"
    if what is None:
        return None
    return (f"capturable=True cannot hold here: {what}. Build the optimizer without capturable=True (eager, or "
            "torch.compile(model, mode=\"reduce-overhead\"), which runs FORGE's updates between its graphs)")


def check_and_unfuse_rows(spec, candidates: dict, **options) -> dict:
    """`ForgeOptimizer(capturable=True)`'s check, before anything is installed: `capturable_refusal` (raised), then
    `candidates` (`installer.candidates`) with every nn.Embedding weight left unfused: its update in backward comes
    in blocks of rows, each with a rounding key of its own, which a table row does not hold; it is stepped from
    .grad in step().

    Raises:
        ValueError: `capturable_refusal`'s reason.
    """
    refusal = capturable_refusal(spec, **options)
    if refusal is not None:
        raise ValueError(refusal)
    return installer.without_embeddings(candidates, "an nn.Embedding under capturable=True: its update comes in "
                                        "blocks of rows, each with its own rounding key, so it is stepped from .grad "
                                        "in step()")


def _detached(outputs: Any) -> Any:
    """`outputs` with every tensor in it detached: a warm-up step's kept by the caller would keep its autograd
    graph (made on the warm-up's stream) alive into the capture, as the recorded one's would into later steps."""
    return torch.utils._pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, outputs)


class CapturedStep:
    """`fn` (a forward and `loss.backward()` on static inputs, returning what the loop reads, e.g. the loss)
    recorded into a CUDA graph with the fused updates of `optimizer` (built with capturable=True), then replayed;
    each call is one whole training step (`optimizer.step()` included) and returns `fn`'s outputs, detached (the
    same tensors every call, refreshed by each replay).

    The first `warmup_steps` calls run `fn` eagerly on a side stream (real training steps, as torch's recipe
    warms up before capturing); the next one records and replays, the later ones replay.

    Raises:
        TypeError: `optimizer` is not a ForgeOptimizer, `fn` is not callable, `warmup_steps` is not an int.
        ValueError: the optimizer was built without capturable=True, its parameters are not on a CUDA device, or
            `warmup_steps` < 1.
    """

    def __init__(self, optimizer, fn: Callable[[], Any], *, warmup_steps: int = 2) -> None:
        if not hasattr(optimizer, "capturable") or not hasattr(optimizer, "_stepper"):  # not a ForgeOptimizer
            raise TypeError(f"optimizer must be a forge_dsl.ForgeOptimizer, got {type(optimizer).__name__}")
        if not callable(fn):
            raise TypeError(f"fn must be callable (the forward and backward to capture), got {type(fn).__name__}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int):
            raise TypeError(f"warmup_steps must be an int, got {type(warmup_steps).__name__}")
        if warmup_steps < 1:
            raise ValueError(f"warmup_steps must be at least 1 (cuBLAS and autograd set up outside the graph), got "
                             f"{warmup_steps}")
        if not optimizer.capturable:
            raise ValueError("CapturedStep needs an optimizer built with capturable=True: its fused updates then "
                             "read each step's host values from device memory, which a replay can refresh")
        devices = {p.device.type for p in optimizer._param_index}
        if devices != {"cuda"}:
            raise ValueError(f"CapturedStep records a CUDA graph: every parameter must be on a CUDA device, found "
                             f"{', '.join(sorted(devices))}")
        self.optimizer = optimizer
        self.fn = fn
        self.warmup_steps = warmup_steps
        self.calls = 0
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self._outputs: Any = None
        self._updated: list = []  # the fused weights' handles whose update the graph holds
        self._grads: dict = {}  # the other parameters' gradients, written by every replay
        self._baked: tuple = ()  # `_what_the_graph_holds` when it was recorded

    def __call__(self) -> Any:
        """One training step; returns `fn`'s outputs."""
        opt = self.optimizer
        stepper = opt._stepper
        self.calls += 1
        if self.graph is None and self.calls <= self.warmup_steps:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out = _detached(self.fn())
                opt.step()
            torch.cuda.current_stream().wait_stream(side)
            opt.zero_grad(set_to_none=True)
            return out
        recorded = self.graph is None
        if not recorded:
            stepper.check_step()  # the param groups' keywords, before anything of the step runs
            self._check_unchanged()
        if stepper.host_table is not None:
            stepper.stage_host_values()  # this step's values, before the graph reads them
        if recorded:
            self._capture()  # the host side of this step runs while recording (the step counters move)
        self.graph.replay()
        if not recorded:
            self._replayed()
        for p, grad in self._grads.items():
            p.grad = grad
        opt.step()
        for p in self._grads:  # a stray optimizer.step() after this call steps nothing twice
            p.grad = None
        return self._outputs

    def _capture(self) -> None:
        """Record `fn` into `self.graph`. The fused updates' host side runs as the recording goes (step counters,
        placeholders); where the recording fails, it is undone (nothing ran on the GPU) and the error raised."""
        opt = self.optimizer
        stepper = opt._stepper
        opt.zero_grad(set_to_none=True)  # the graph's backward writes the gradients from its own pool
        counters = {p: stepper.state[p]["step"].clone() for p in stepper.table_slots if "step" in stepper.state[p]}
        graph = torch.cuda.CUDAGraph()
        stepper.capture_allowed = True
        try:
            with torch.cuda.graph(graph):
                self._outputs = _detached(self.fn())
        except BaseException:
            for p, count in counters.items():
                stepper.state[p]["step"].copy_(count)
            stepper.progress.forget_forwards()
            stepper.progress.end()
            opt.zero_grad(set_to_none=True)
            raise
        finally:
            stepper.capture_allowed = False
        self.graph = graph
        self._baked = self._what_the_graph_holds()
        progress = stepper.progress
        self._updated = [h for h in progress.weights.values() if h.updated]
        self._grads = {p: p.grad for p in opt._param_index
                       if p.grad is not None and not isinstance(p.grad, ConsumedGrad)}

    def _what_the_graph_holds(self) -> tuple:
        """What the recorded kernels were built for and point to, beyond the host table's values: the rounding,
        each fused weight's variant (its flags), and the addresses of every parameter and state tensor."""
        stepper = self.optimizer._stepper
        groups = {id(g): g for g in map(stepper.group_of.get, stepper.table_slots)}  # each group once, every replay
        variant_of = {key: resolved_hypers(stepper.spec, stepper.group_hypers(g)).variant for key, g in groups.items()}
        variants = tuple(variant_of[id(stepper.group_of[p])] for p in stepper.table_slots)
        addresses = tuple((p.data_ptr(), tuple(t.data_ptr() for t in stepper.state[p].values()
                                               if isinstance(t, torch.Tensor) and t.is_cuda))
                          for p in self.optimizer._param_index)
        return stepper.rounding, variants, addresses

    def _check_unchanged(self) -> None:
        """Refuse a replay whose graph no longer fits the optimizer (before anything of the step runs)."""
        if self._what_the_graph_holds() != self._baked:
            raise ValueError(
                "CapturedStep: since the step was recorded, the optimizer's rounding, a flag among the param groups' "
                "keywords (e.g. amsgrad), or a parameter or state tensor (model.to(), load_state_dict of another "
                "layout) changed; the recorded kernels would not see it. Nothing of this step ran: build a new "
                "CapturedStep (it records again)")

    def _replayed(self) -> None:
        """The host side of a replayed step, as its eager backward would leave it: each fused weight updated by the
        graph counts the step and gets its placeholder `.grad`."""
        stepper = self.optimizer._stepper
        for handle in self._updated:
            weight = handle.weight_ref()
            stepper.state[weight]["step"] += 1
            stepper.progress.mark_updated(handle)
