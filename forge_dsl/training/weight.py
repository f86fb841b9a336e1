"""One fused weight, the forward installed on its module, and the step they go through together.

    handle = FusedWeight(stepper, module, name)      a Linear's or an Embedding's weight, fused by one optimizer
    module.forward = FusedForward(module, handle, run)   its forward while the optimizer lives (`installer`)
    stepper.progress                                  the `StepProgress` of that optimizer's step

A step of a fused weight, as `StepProgress` moves it: each forward with gradients is counted
(`note_forward`); in backward, `begin_update` decides whether this step's update is fused (one use) or left to
autograd (several uses: a shared layer), then the stepper applies the update (`consume`: from x and dy; or
`begin` … `finish`: from blocks of rows, a `row_updates.RowSink`) and the weight is marked updated, with a
`ConsumedGrad` as its `.grad`; `ForgeOptimizer.step()` ends the step (`StepProgress.end`), closing first what an
interrupted backward left open (`close_interrupted`).

A handle asks its optimizer only through the stepper's public methods (`stepper.linear`, `begin_rows`,
`finish_rows`), held weakly: once the optimizer is gone its handles are `detached`, and the installed forward
gives the module back its own. A module whose weight was replaced (`module.weight = nn.Parameter(...)`) runs its
own forward while the handle holds the old weight (`FusedWeight.replaced`): the new weight gets a `.grad` as
under torch.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import weakref
from typing import Any, Callable, Optional

import torch

from ..kernels.policy import SLAB_BYTES
from ..kernels.slabs import slab_grads
from . import tensor_parallel
from .consumed_grad import OUTSIDE_USE_MESSAGE, ConsumedGrad, ReportingGrad, consumed_grad
from .grad_passes import ACCUMULATE, APPLY, MEASURE, SCALED, UPDATE, GradRows, square_sum

__all__ = ["FusedWeight", "FusedForward", "StepProgress", "base_forward", "forward_of", "handle_by_id", "host_range",
           "instance_forward_refusal", "is_dormant_forward", "meta_refusal", "rows_of"]

_MISSING = object()
_NO_RANGE = contextlib.nullcontext()


def host_range(name: str):
    """A `torch.profiler` range named `name` around FORGE's host work while a profiler runs (what
    `forge_dsl.bench.step_anatomy` counts as FORGE's host time); nothing otherwise (a range costs µs per layer)."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return _NO_RANGE


class StepProgress:
    """The step one optimizer and its fused weights go through: the one state machine of a step.

    `weights` maps each fused parameter to its `FusedWeight`; `backward_open` is set while a backward that
    applied a fused update has not finished (the autograd engine clears it at the end of that backward, not when
    an exception ends it: then `ForgeOptimizer.step()` finds it set and closes the step)."""

    def __init__(self) -> None:
        self.weights: dict[torch.nn.Parameter, FusedWeight] = {}
        self.backward_open = False
        self.step_checked = False  # `ParamStepper.check_step` passed in this step
        # global-norm clipping and gradient accumulation (`grad_passes`), as the optimizer was constructed
        self.max_grad_norm: Optional[float] = None
        self.accumulation_steps = 1
        self.accumulation_dtype = torch.float32
        self.grad_pass = UPDATE  # MEASURE or SCALED inside `ForgeOptimizer.backward`'s two passes
        self.grad_scale: Optional[torch.Tensor] = None  # the clip coefficient, in the SCALED pass
        self.squares: Optional[torch.Tensor] = None  # the fused weights' summed squared norms, in the MEASURE pass
        self.clip: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (norm, coefficient) of this step's passes

    def mode_for(self, handle: "FusedWeight") -> str:
        """How `handle`'s gradient is used in this backward, where its update is fused: `grad_passes`' modes.
        Refuses a plain backward that would apply an update unclipped where the optimizer clips."""
        if self.grad_pass != UPDATE:
            return self.grad_pass
        if self.accumulation_steps > 1:
            last = handle.micro_batches + 1 >= self.accumulation_steps
            return APPLY if last and self.max_grad_norm is None else ACCUMULATE
        if self.max_grad_norm is not None:
            self.forget_forwards()  # refused: the batch runs again from its forward
            raise RuntimeError(
                f"'{handle.name}': this optimizer clips by the global gradient norm (max_grad_norm="
                f"{self.max_grad_norm:g}), which each fused update must know before it runs: call "
                "optimizer.backward(loss) instead of loss.backward() (Hugging Face Trainer: forge_dsl.ForgeTrainer). "
                "No weight was updated in this step: call optimizer.zero_grad() and run the batch again.")
        return UPDATE

    def forget_forwards(self) -> None:
        """Forget this step's forward counts: a backward was refused or failed before any update, and the batch
        runs again from its forward (which would otherwise count twice and make every layer look shared)."""
        for handle in self.weights.values():
            handle.forward_uses = 0

    def add_squares(self, squares: torch.Tensor) -> None:
        """A fused weight's squared gradient norm, in the MEASURE pass."""
        self.squares = squares.clone() if self.squares is None else self.squares + squares.to(self.squares.device)

    def accumulated(self) -> list["FusedWeight"]:
        """The fused weights holding an accumulation buffer not yet applied."""
        return [h for h in self.weights.values() if h.buffer is not None]

    def open_backward(self) -> None:
        """A fused update runs in the current backward (the stepper says so once the weight's state exists)."""
        if not self.backward_open:
            self.backward_open = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_finished)

    def _backward_finished(self) -> None:
        self.backward_open = False

    def updated_count(self) -> tuple[int, int]:
        """(fused weights updated in this step, fused weights)."""
        return sum(h.updated for h in self.weights.values()), len(self.weights)

    def note_forward(self, handle: "FusedWeight") -> None:
        """A forward with gradients through `handle`'s layer (recomputation inside backward, by checkpointing,
        excluded): counted, or refused where this step's update already ran."""
        if torch._C._current_graph_task_id() != -1:
            return
        if handle.updated:
            # Refuse before the next micro-batch's backward can apply a second update.
            if self.backward_open:
                raise RuntimeError(_interrupted_message(handle.name, *self.updated_count()))
            raise RuntimeError(_accumulation_message(handle.name, self.accumulation_steps) + " (This forward, with "
                               "gradients enabled, came after that backward and before optimizer.step().)")
        handle.forward_uses += 1

    def begin_update(self, handle: "FusedWeight") -> bool:
        """In backward, before `handle`'s update: True where this step's update is fused, False where the weight
        was used several times in this step (each use's gradient goes to autograd, summed into .grad). Refuses a
        second update in one step, and a gradient that reached the weight from another use first."""
        if handle.updated:
            raise RuntimeError(_accumulation_message(handle.name, self.accumulation_steps))
        if handle.rows is not None:  # blocks of an interrupted backward's update were applied
            raise RuntimeError(_interrupted_message(handle.name, *self.updated_count()))
        # Decided per step: a layer called several times in this forward (a shared layer, or a stray forward
        # with grad enabled since the last step) hands each use's dW to autograd, summed into .grad.
        weight = handle.weight_ref()
        handle.shared = handle.forward_uses > 1
        handle.bypassed = False
        if handle.buffer is not None and weight.grad is None:  # zero_grad() dropped the accumulated micro-batches
            handle.drop_buffer()
        if isinstance(weight.grad, ConsumedGrad):  # a step's placeholder left by a loop without zero_grad()
            weight.grad = None
        if handle.shared:
            return False
        if weight.grad is not None:  # refused before the update: a gradient from another use came first
            raise RuntimeError(f"'{handle.name}': " + OUTSIDE_USE_MESSAGE)
        return True

    def mark_updated(self, handle: "FusedWeight") -> None:
        """`handle`'s update of this step is applied: what reads its `.grad` from now on (clipping, however
        imported) learns that the gradient was consumed here, or, where this optimizer clipped it, its norm."""
        handle.updated = True
        weight = handle.weight_ref()
        if self.grad_pass == SCALED and handle.squares is not None:
            weight.grad = ReportingGrad(weight, handle.name, handle.squares.sqrt)
        else:
            weight.grad = handle.consumed_grad()

    def close_interrupted(self) -> tuple[int, int]:
        """Close what a backward interrupted by an exception left open: a weight interrupted between blocks of
        rows counts as updated (its step counter moves). Returns `updated_count()` after that."""
        for handle in self.weights.values():
            if handle.close_rows():
                handle.updated = True
        return self.updated_count()

    def end(self) -> None:
        """The step is over (`ForgeOptimizer.step()`): every fused weight may be used again."""
        self.backward_open = False
        self.step_checked = False
        self.clip = None
        self.end_pass()
        for handle in self.weights.values():
            handle.forward_uses = 0
            handle.updated = False
            handle.squares = None

    def end_pass(self) -> None:
        """Back to plain backwards after `ForgeOptimizer.backward`'s pass (finished or interrupted)."""
        self.grad_pass = UPDATE
        self.grad_scale = None
        self.squares = None
        for handle in self.weights.values():
            handle.pass_rows = None

    def drop_accumulated(self) -> None:
        """Forget the accumulated gradients (`zero_grad()`, as torch's clears accumulated `.grad`s)."""
        for handle in self.weights.values():
            handle.drop_buffer()


_HANDLE_IDS = itertools.count(1)
_HANDLES: "weakref.WeakValueDictionary[int, FusedWeight]" = weakref.WeakValueDictionary()


def handle_by_id(handle_id: int) -> Optional["FusedWeight"]:
    """The live `FusedWeight` of an id (how a compiled graph's custom ops name their layer), or None."""
    return _HANDLES.get(handle_id)


class FusedWeight:
    """One fused weight (an nn.Linear's or nn.Embedding's): its uses in this step (kept by `StepProgress`), and
    the update, applied by its optimizer's stepper (`forge_dsl.training.stepper.ParamStepper`, held weakly).

    It is also a `row_updates.RowSink`: the fused embedding and the fused LM head's loss hand it their weight's
    gradient in blocks of rows, updated as they come."""

    def __init__(self, stepper, module: torch.nn.Module, name: str) -> None:
        self.id = next(_HANDLE_IDS)
        _HANDLES[self.id] = self
        self.stepper_ref = weakref.ref(stepper)
        self.progress: StepProgress = stepper.progress
        self.module_ref = weakref.ref(module)
        self.weight_ref = weakref.ref(module.weight)
        self.name = name
        self.forward_uses = 0  # calls with grad in this step (recomputation inside backward excluded)
        self.updated = False  # the fused update of this step has run
        self.shared = False  # the last backward found it called several times in one step: stepped unfused
        # the last step() found a gradient of it that its module's forward never saw (the weight read directly,
        # e.g. by Liger-Kernel's fused linear cross-entropy): stepped from .grad
        self.bypassed = False
        # why its last forward took torch's own path (a tensor-parallel sharding whose dW is a partial sum)
        self.plain_reason: Optional[str] = None
        self.rows = None  # the step bound by `begin` (a kernels.ParamUpdate), until `finish`
        self.pass_rows: Optional[GradRows] = None  # this backward's `grad_passes` work, until its last block
        self.buffer: Optional[torch.Tensor] = None  # the accumulated gradient [N, K] (accumulation_steps > 1)
        self.micro_batches = 0  # backwards added into `buffer`
        self.squares: Optional[torch.Tensor] = None  # ‖grad‖² of this step's MEASURE pass (0-d float32)
        self._consumed: Optional[ConsumedGrad] = None  # the weight's placeholder .grad, made once (no memory)

    @property
    def detached(self) -> bool:
        """Whether its optimizer is gone (its module then runs its own forward again)."""
        return self.stepper_ref() is None

    @property
    def replaced(self) -> bool:
        """Whether its module's weight is no longer this handle's (`module.weight = nn.Parameter(...)`, or
        `model.to("meta")`, which makes new Parameters): the module then runs its own forward."""
        module = self.module_ref()
        return module is not None and module.weight is not self.weight_ref()

    def note_forward(self) -> None:
        """A forward with gradients through this weight's layer (`StepProgress.note_forward`)."""
        self.progress.note_forward(self)

    def consumed_grad(self) -> ConsumedGrad:
        """The weight's placeholder `.grad`, made again only where the weight's metadata changed (model.to())."""
        weight = self.weight_ref()
        kept = self._consumed
        if kept is None or (kept.shape, kept.dtype, kept.device) != (weight.shape, weight.dtype, weight.device):
            kept = self._consumed = consumed_grad(weight, self.name)
        return kept

    def _stepper(self):
        stepper = self.stepper_ref()
        if stepper is None:
            raise RuntimeError(f"the ForgeOptimizer of '{self.name}' no longer exists")
        return stepper

    def consume(self, x: torch.Tensor, dy: torch.Tensor) -> Optional[torch.Tensor]:
        """In backward: the fused update of this layer's weight from x [..., K] and dy [..., N] (None), or, where
        it is not fused this step, its dW [N, K] for autograd. A weight sharded by tensor parallelism (x, dy and
        dW this rank's shards) gets an unfused step's dW added to its `.grad` here, as the DTensor of its shard,
        and None is returned: its forward hands autograd only the local shard, which has no gradient edge."""
        stepper = self._stepper()
        weight = self.weight_ref()
        if not self.progress.begin_update(self):
            dw = _dw(x, dy, weight)
            if tensor_parallel.is_dtensor(weight):
                tensor_parallel.add_to_grad(weight, dw)
                return None
            return dw
        mode = self.progress.mode_for(self)
        if mode == UPDATE:
            with host_range("forge::linear_update"):
                stepper.linear(weight, x, dy)
            self.progress.mark_updated(self)
            return None
        sink = self._open(stepper, mode)
        with host_range("forge::linear_" + mode):
            for r0, slab in slab_grads(rows_of(x), rows_of(dy), SLAB_BYTES):
                sink.add(slab, r0)
        self._close()
        return None

    def _open(self, stepper, mode: str) -> GradRows:
        """This backward's `GradRows` for `mode` (not UPDATE): the step bound where it updates, the buffer made
        where it accumulates."""
        weight = self.weight_ref()
        update = None
        if mode in (SCALED, APPLY):
            update = self.rows = stepper.begin_rows(weight)
        if mode in (ACCUMULATE, APPLY) and self.buffer is None:
            self.buffer = torch.zeros(weight.shape, dtype=self.progress.accumulation_dtype, device=weight.device)
        self.pass_rows = GradRows(mode, update=update, buffer=self.buffer, scale=self.progress.grad_scale,
                                  device=weight.device)
        return self.pass_rows

    def _close(self) -> None:
        """After the last block of a `GradRows`: its squared norm kept, its micro-batch counted, or its update
        finished (its step counter moves)."""
        sink, self.pass_rows = self.pass_rows, None
        weight = self.weight_ref()
        if sink.mode == MEASURE:
            self.squares = sink.squares
            self.progress.add_squares(sink.squares)
        elif sink.mode == ACCUMULATE:
            self.micro_batches += 1
            self.forward_uses = 0  # counted per micro-batch
            if self.progress.max_grad_norm is None:
                placeholder = consumed_grad(weight, self.name)
            else:  # clipped in step(): clip_grad_norm_ before it reads the buffer's norm
                placeholder = ReportingGrad(weight, self.name, functools.partial(_buffer_norm, weakref.ref(self)))
            placeholder.on_zero = self.drop_buffer  # zero_grad(set_to_none=False) drops the micro-batches
            weight.grad = placeholder
        else:
            self.close_rows()
            if sink.mode == APPLY:
                self.drop_buffer()
            self.progress.mark_updated(self)

    def drop_buffer(self) -> None:
        """Free the accumulation buffer (applied, or cleared by `zero_grad()`)."""
        self.buffer = None
        self.micro_batches = 0

    # -- row_updates.RowSink: a weight whose gradient comes in blocks of rows (embeddings, the LM head's loss)
    def begin(self) -> bool:
        """True: this step's update is fused, its blocks of rows come next; False: autograd gets the gradient."""
        stepper = self._stepper()
        if not self.progress.begin_update(self):
            return False
        mode = self.progress.mode_for(self)
        if mode == UPDATE:
            self.rows = stepper.begin_rows(self.weight_ref())
        else:
            self._open(stepper, mode)
        return True

    def fused_rows(self, x: torch.Tensor, dy: torch.Tensor, r0: int) -> None:
        """Rows [r0, r0 + R) from dW = dyᵀ x: x [T, K], dy [T, R]."""
        with host_range("forge::rows_update"):
            if self.pass_rows is not None:  # dW's rows as autograd rounds them
                self.pass_rows.add(rows_of(dy).t().matmul(rows_of(x)), r0)
                return
            self.rows.fused(x, dy, rows=r0, tf32=torch.get_float32_matmul_precision() != "highest")

    def grad_rows(self, grad: torch.Tensor, r0: int) -> None:
        """Rows [r0, r0 + R) from their gradient grad [R, K]."""
        with host_range("forge::rows_update"):
            if self.pass_rows is not None:
                self.pass_rows.add(grad, r0)
                return
            self.rows.from_grad(grad, rows=r0)

    def finish(self) -> None:
        """After the last block: the step's scalar state and counter move, the weight counts as updated."""
        if self.pass_rows is not None:
            self._close()
            return
        self.close_rows()
        self.progress.mark_updated(self)

    def close_rows(self) -> bool:
        """Complete a begun row update (its scalar state and step counter move); False where none is open.
        `ForgeOptimizer.step()` closes one an interrupted backward left open: its rows handed so far keep
        this step's update, the others went without it."""
        update, self.rows = self.rows, None
        if update is None:
            return False
        stepper = self.stepper_ref()
        if stepper is not None:
            stepper.finish_rows(self.weight_ref(), update)
        return True


def _interrupted_message(name: str, updated: int, fused: int) -> str:
    return (
        f"'{name}' was already updated in this step: the last backward was interrupted (an exception inside "
        f"backward) after FORGE had applied the update of {updated} of the {fused} fused layers, which keep it "
        f"(their step counters moved). Call optimizer.step() to close the step (it steps no parameter from the "
        f"incomplete gradients that backward left) and optimizer.zero_grad(), then run the batch again."
    )


def _accumulation_message(name: str, accumulation_steps: int) -> str:
    if accumulation_steps > 1:
        return (f"'{name}' received a gradient after the backward that completed this step's "
                f"accumulation_steps={accumulation_steps} micro-batches, in which FORGE applied the update of the "
                f"accumulated gradient: call optimizer.step() after every {accumulation_steps} backwards (or construct "
                "the optimizer with the accumulation_steps your loop runs).")
    return (
        f"'{name}' received a second gradient before optimizer.step(): FORGE already applied this step's update "
        f"inside the first backward, from that backward's gradient alone (it was never stored). For gradient "
        f"accumulation over k micro-batches, construct the optimizer with ForgeOptimizer(..., accumulation_steps=k) "
        f"(a float32 buffer per fused weight; the k-th backward applies the update), or with fuse=False (every "
        f"parameter stepped from .grad, as torch does). A second backward through the same graph, or a layer called "
        f"twice inside a reentrant checkpoint, cannot be exact either. Otherwise call optimizer.step() after every "
        f"backward."
    )


def _buffer_norm(handle_ref) -> torch.Tensor:
    """The 2-norm of a fused weight's accumulation buffer as it is now (0-d float32; 0 where it was dropped)."""
    handle = handle_ref()
    if handle is None or handle.buffer is None:
        return torch.zeros((), dtype=torch.float32)
    return square_sum(handle.buffer).sqrt()


def _dw(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """dW = dyᵀ x [N, K] in the weight's dtype, as autograd computes it, from x [..., K] and dy [..., N]."""
    return rows_of(dy).t().matmul(rows_of(x)).to(weight.dtype)


def rows_of(t: torch.Tensor) -> torch.Tensor:
    """t [..., C] as [tokens, C]; C may be 0 (a Linear without outputs), where reshape(-1, C) cannot infer."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


# ----------------------------------------------------------------------------
# The forward installed on a fused module
# ----------------------------------------------------------------------------


def base_forward(module: torch.nn.Module) -> Callable:
    """The class forward a fused module runs when not fused: nn.Embedding's or nn.Linear's own."""
    return torch.nn.Embedding.forward if isinstance(module, torch.nn.Embedding) else torch.nn.Linear.forward


def is_dormant_forward(module: torch.nn.Module, forward: Any) -> bool:
    """Whether `forward` (an instance attribute) is what a copy of a fused module holds: its class's own forward
    bound to the module (`FusedForward.__reduce__`)."""
    return (isinstance(forward, functools.partial) and forward.func is base_forward(module)
            and len(forward.args) == 1 and forward.args[0] is module and not forward.keywords)


class FusedForward:
    """The instance-level `forward` of a fused nn.Linear or nn.Embedding: `run(module, handle, input)` while its
    optimizer lives, the class's own forward after (the module is then given back what it had). A copy
    (deepcopy, pickle, `torch.save`) is the class's own forward bound to the copied module: a copied model is a
    plain model."""

    __slots__ = ("module_ref", "handle", "run", "previous", "__weakref__")

    def __init__(self, module: torch.nn.Module, handle: FusedWeight, run: Callable) -> None:
        self.module_ref = weakref.ref(module)
        self.handle = handle
        self.run = run
        self.previous = module.__dict__.get("forward", _MISSING)  # a copy's dormant forward, or nothing

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        module = self.module_ref()
        handle = self.handle
        if handle.detached:  # its optimizer is gone: the plain module again
            self.restore()
            return base_forward(module)(module, input)
        weight = module.weight
        if weight.is_meta and torch.is_grad_enabled() and weight.requires_grad:
            raise RuntimeError(meta_refusal(f"'{handle.name}'"))
        if weight is not handle.weight_ref():  # replaced: trained as any parameter, from its .grad
            return base_forward(module)(module, input)
        return self.run(module, handle, input)

    def restore(self) -> None:
        """Give the module back the forward it had before it was fused."""
        module = self.module_ref()
        if module is not None and module.__dict__.get("forward") is self:
            if self.previous is _MISSING:
                del module.forward
            else:
                module.forward = self.previous

    def __reduce__(self):
        module = self.module_ref()
        return functools.partial, (base_forward(module), module)


def meta_refusal(label: str) -> str:
    """The message for a parameter (`label`: how the message names it) on the meta device, mid-run."""
    return (f"{label} is on the meta device, which holds no data: the model was moved with model.to('meta') (or "
            "a parameter's .data was replaced) after its optimizer was made. model.to('meta') and "
            "model.to_empty() give every module new Parameters, which this optimizer does not hold: materialize "
            "the model (model.to_empty(device=...), then load its weights), build a new optimizer for it and load "
            "this one's state_dict() into it")


def forward_of(module: torch.nn.Module) -> Optional[FusedForward]:
    """The `FusedForward` installed on `module`, or None."""
    forward = module.__dict__.get("forward")
    return forward if isinstance(forward, FusedForward) else None


def instance_forward_refusal(module: torch.nn.Module, also_forge: Callable[[Any], bool] = lambda f: False
                             ) -> Optional[str]:
    """Why an instance-level `forward` of `module` keeps it from being fused (None: there is none, or it is
    FORGE's: a `FusedForward`, a copy's dormant forward, or what `also_forge` accepts)."""
    forward = module.__dict__.get("forward", _MISSING)
    if forward is _MISSING or isinstance(forward, FusedForward) or is_dormant_forward(module, forward):
        return None
    if also_forge(forward):
        return None
    return "its forward was replaced on the instance (e.g. by a hook library), which FORGE does not replace"
