"""How `forge-bench model` accounts for a training step's memory: the pools it defines (its --help, in
`forge_dsl.bench.model`'s docstring) measured by the allocator's statistics.

`StepMemory` cuts a step into `PHASES` and keeps each phase's peak; `SavedBytes` counts what autograd saves
during the decoder's forward (what OffloadActivations moved to the host apart); `instrument` hooks both onto a
model; `resident_at_peak` splits the peak into the pools resident then.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..training.consumed_grad import ConsumedGrad
from ..training.offload import Kept, OffloadActivations
from .parallel import local_nbytes

__all__ = ["PHASES", "SavedBytes", "StepMemory", "instrument", "materialized_grad_bytes", "resident_at_peak"]

# the phases a StepMemory cuts a step into, in order
PHASES = ("forward", "loss", "backward", "optimizer")


class SavedBytes:
    """Bytes of the tensors autograd saves for backward while entered (`torch.autograd.graph.saved_tensors_hooks`):
    one count per storage, the storages whose data pointers are in `exclude` (the parameters) left out. With
    `offload` (an OffloadActivations, whose hooks these replace while entered), each tensor goes through it:
    `bytes` counts what stays on the device, `offloaded` what it copied to host memory (its own count: a moved
    tensor's device memory is freed and its address may be handed out again while entered)."""

    def __init__(self, exclude: set, offload: Optional[OffloadActivations] = None) -> None:
        self.exclude = exclude
        self.offload = offload
        self.seen: set = set()
        self.bytes = 0
        self.offloaded = 0
        self._offloaded_before = 0
        self._hooks = None

    def _pack(self, t: torch.Tensor):
        packed = self.offload.pack(t) if self.offload is not None else Kept(t)
        if self.offload is not None and self.offload.moved(packed):
            return packed
        for storage in _storages(t):
            ptr = storage.data_ptr()
            if ptr not in self.exclude and ptr not in self.seen:
                self.seen.add(ptr)
                self.bytes += storage.nbytes()
        return packed

    def _unpack(self, packed):
        return self.offload.unpack(packed) if self.offload is not None else packed.unpack()

    def __enter__(self) -> "SavedBytes":
        self._offloaded_before = self.offload.bytes_offloaded if self.offload is not None else 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        hooks, self._hooks = self._hooks, None
        hooks.__exit__(*exc)
        if self.offload is not None:
            self.offloaded = self.offload.bytes_offloaded - self._offloaded_before


def _storages(t: torch.Tensor) -> list:
    """The storages holding `t`'s data: its own, or a tensor subclass's inner tensors' (a DTensor's local shard, a
    functional collective's result), which are what the allocator holds."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        inner = (getattr(t, name) for name in names)
        return [s for x in inner if isinstance(x, torch.Tensor) for s in _storages(x)]
    return [t.untyped_storage()]


class StepMemory:
    """One training step cut into `PHASES` by the allocator's statistics: at each `cut(next)`, the peak of the
    phase that ends (max_memory_allocated since the last cut), then what is allocated and the gradient bytes
    materialized as `next` starts, then the peak statistic reset. Only on CUDA (elsewhere nothing is recorded);
    no synchronization is needed, the caching allocator counts on the host as it hands out blocks."""

    def __init__(self, device: torch.device, grad_bytes: Callable[[], int]) -> None:
        self.device = device
        self.grad_bytes = grad_bytes
        self.phase: Optional[str] = None
        self.peaks: dict = {}  # phase -> bytes
        self.allocated_at: dict = {}  # phase -> bytes allocated as it starts
        self.grads_at: dict = {}  # phase -> gradient bytes materialized as it starts
        self.activations: Optional[int] = None  # SavedBytes of the decoder's forward, when measured
        self.offloaded: Optional[int] = None  # and what of it went to host memory (--offload on)

    def cut(self, next_phase: Optional[str]) -> None:
        if self.device.type != "cuda":
            return
        if self.phase is not None:
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), torch.cuda.max_memory_allocated(self.device))
        if next_phase is not None:
            self.allocated_at[next_phase] = torch.cuda.memory_allocated(self.device)
            self.grads_at[next_phase] = self.grad_bytes()
        self.phase = next_phase
        torch.cuda.reset_peak_memory_stats(self.device)

    def end_loss(self) -> None:
        """The gradient reached the logits (or the decoder's output): the loss phase ends, if it is on."""
        if self.phase == "loss":
            self.cut("backward")

    @property
    def peak(self) -> Optional[int]:
        return max(self.peaks.values()) if self.peaks else None

    @property
    def logits(self) -> Optional[int]:
        """The loss's own memory: its phase's peak above what was allocated as it started."""
        if "loss" not in self.peaks:
            return None
        return self.peaks["loss"] - self.allocated_at["loss"]


def materialized_grad_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters' .grad (this rank's shards); a fused weight's .grad after its update is a
    ConsumedGrad, which holds none."""
    return sum(local_nbytes(p.grad) for p in model.parameters()
               if p.grad is not None and not isinstance(p.grad, ConsumedGrad))


def instrument(model: torch.nn.Module, get_meter: Callable[[], Optional[StepMemory]],
               hook_head: bool = True, offload: Optional[OffloadActivations] = None) -> Callable[[], None]:
    """Hooks that cut the step of `get_meter()` (when it returns one) into phases and count the decoder's saved
    activations: the decoder (`model.model`) forward's end starts the loss; the gradient at `model.lm_head`'s
    output (with `hook_head`; else, and where the head is not called, at the decoder's output) starts the
    backward. `hook_head` must be False under the fused head, which refuses a head with forward hooks (it never
    calls the head). With `offload`, the decoder's saved tensors still go through it. Returns the remover."""
    decoder, head = model.model, (getattr(model, "lm_head", None) if hook_head else None)
    params = {storage.data_ptr() for p in model.parameters() for storage in _storages(p)}
    counting: list = []

    def before_decoder(module, args, kwargs):
        meter = get_meter()
        if meter is not None:
            counting.append(SavedBytes(params, offload).__enter__())

    def after_decoder(module, args, kwargs, output):
        meter = get_meter()
        if meter is None:
            return
        if counting:
            saved = counting.pop()
            saved.__exit__(None, None, None)
            meter.activations, meter.offloaded = saved.bytes, saved.offloaded
        meter.cut("loss")
        hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
        if hidden.requires_grad:
            hidden.register_hook(lambda grad: meter.end_loss())

    def after_head(module, args, output):
        meter = get_meter()
        if meter is not None and output.requires_grad:
            output.register_hook(lambda grad: meter.end_loss())

    handles = [decoder.register_forward_pre_hook(before_decoder, with_kwargs=True),
               decoder.register_forward_hook(after_decoder, with_kwargs=True)]
    if head is not None:
        handles.append(head.register_forward_hook(after_head))

    def remove():
        for handle in handles:
            handle.remove()

    return remove


def resident_at_peak(meter: StepMemory, weights: int, state: int, leftover: int) -> dict:
    """The pools resident at the step's peak, in bytes, adding up to it: weights and optimizer state always;
    in the loss phase the decoder's saved activations, the logits and the gradients materialized at its end; in
    the forward phase the gradients at its end; in the backward and optimizer phases the gradients at the end of
    backward; what an earlier run left allocated (`leftover`); the workspace, the rest."""
    peak = meter.peak
    phase = max(meter.peaks, key=meter.peaks.get)
    pools = {"weights": weights, "optimizer_state": state, "gradients": 0, "logits": 0, "activations": 0,
             "leftover": leftover}
    grads_end = meter.grads_at.get("optimizer", 0)  # as the optimizer phase starts: at the end of backward
    if phase == "forward":
        pools["gradients"] = meter.grads_at.get("loss", grads_end)
    elif phase == "loss":
        pools["gradients"] = meter.grads_at.get("backward", grads_end)
        pools["logits"] = meter.logits or 0
        pools["activations"] = meter.activations or 0
    else:
        pools["gradients"] = grads_end
    pools["workspace"] = peak - sum(pools.values())
    return {"phase": phase, "peak": peak, "pools": pools}
