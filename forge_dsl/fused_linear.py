"""A fused nn.Linear or nn.Embedding: the forward that runs FORGE's update inside backward, and its bookkeeping.

    module.forward = _FusedForward(module, handle)       installed by ForgeOptimizer (forge_dsl/optim.py)
    y = fused_forward(module, handle, x)                  y = x Wᵀ + b [..., N]; backward: ΔX [..., K] with the
                                                           old W [N, K], then the fused update of W and its state
    y = embedding_forward(module, ids, handle)            an embedding's rows (forge_dsl/fused_embedding.py); its
                                                           backward hands the handle its gradient a tile at a time

A handle is also a `row_updates.RowSink`: the fused embedding and the fused LM head's loss
(`forge_dsl.fused_head`) hand it their weight's gradient in blocks of rows, updated as they come.

Two entry points reach the same code (`_FusedHandle.note_forward`, `_FusedHandle.consume`):

* eager: `_ForgeLinearFn`, an autograd.Function (the fewest host µs per call);
* under `torch.compile` (`torch.compiler.is_compiling()`): the torch custom ops `forge_dsl::linear` and
  `forge_dsl::linear_backward`, whose registered autograd calls the second from the first's backward. Both
  are opaque to the compiler, so a compiled model has no graph break from FORGE (`fullgraph=True` works)
  and computes what eager computes. A layer's handle reaches them as an int (`_HANDLES`).

The backward path of a layer that is not fused this step (called several times in one forward, or whose
optimizer is gone) hands its dW to autograd in eager mode, and under compile adds it to `weight.grad`
itself (the ops' signature is static), as autograd would.
"""

from __future__ import annotations

import functools
import itertools
import math
import weakref
from typing import Any, Optional

import torch
from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

from . import tensor_parallel
from .consumed_grad import OUTSIDE_USE_MESSAGE, ConsumedGrad, consumed_grad
from .fused_embedding import embedding_forward, fusion_refusal as embedding_refusal

__all__ = ["fused_forward", "fusion_refusal"]


_MISSING = object()


def _base_forward(module: torch.nn.Module):
    """The class forward a fused module runs when not fused: nn.Embedding's or nn.Linear's own."""
    return torch.nn.Embedding.forward if isinstance(module, torch.nn.Embedding) else torch.nn.Linear.forward


def _is_dormant_forward(module: torch.nn.Module, forward: Any) -> bool:
    """Whether `forward` (an instance attribute) is what a copy of a fused module holds: nn.Linear's own forward
    bound to the module (`_FusedForward.__reduce__`)."""
    return (isinstance(forward, functools.partial) and forward.func is torch.nn.Linear.forward
            and len(forward.args) == 1 and forward.args[0] is module and not forward.keywords)


class _FusedForward:
    """The instance-level `forward` of a fused nn.Linear or nn.Embedding: the FORGE path while its optimizer
    lives, the class's own forward after (the module is then given back what it had). A copy (deepcopy,
    pickle, `torch.save`) is the class's own forward bound to the copied module: a copied model is a plain
    model."""

    __slots__ = ("module_ref", "handle", "previous", "__weakref__")

    def __init__(self, module: torch.nn.Linear, handle: "_FusedHandle") -> None:
        self.module_ref = weakref.ref(module)
        self.handle = handle
        self.previous = module.__dict__.get("forward", _MISSING)  # a copy's dormant forward, or nothing

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        module = self.module_ref()
        if self.handle.opt_ref() is None:  # its optimizer is gone: the plain module again
            self.restore()
            return _base_forward(module)(module, input)
        if isinstance(module, torch.nn.Embedding):
            if (torch.is_grad_enabled() and module.weight.requires_grad and not torch.compiler.is_compiling()):
                self.handle.note_forward()
            return embedding_forward(module, input, self.handle)
        return fused_forward(module, self.handle, input)

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
        return functools.partial, (_base_forward(module), module)


def _fused_forward_of(module: torch.nn.Module) -> Optional[_FusedForward]:
    forward = module.__dict__.get("forward")
    return forward if isinstance(forward, _FusedForward) else None


def fusion_refusal(module: torch.nn.Module) -> Optional[str]:
    """Why FORGE does not fuse this module's weight (None: it does, if the weight is trained and not shared).

    Only an nn.Linear whose forward is nn.Linear's own is fused: a subclass with its own forward
    (`torch.ao.nn.qat.Linear`'s fake quantization, a scaled output) or a forward replaced on the instance (by
    a hook library) would silently lose what it does. nn.MultiheadAttention reads its out_proj's weight
    directly, never through out_proj's forward. An nn.Embedding: `fused_embedding.fusion_refusal`."""
    if isinstance(module, torch.nn.Embedding):
        return embedding_refusal(module)
    if not isinstance(module, torch.nn.Linear):
        return "not an nn.Linear or nn.Embedding"
    if isinstance(module, torch.nn.modules.linear.NonDynamicallyQuantizableLinear):
        return "read directly by nn.MultiheadAttention"
    if type(module).forward is not torch.nn.Linear.forward:
        return f"{type(module).__qualname__} has its own forward, which FORGE does not replace"
    forward = module.__dict__.get("forward", _MISSING)
    if forward is not _MISSING and not isinstance(forward, _FusedForward) and not _is_dormant_forward(module, forward):
        return "its forward was replaced on the instance (e.g. by a hook library), which FORGE does not replace"
    return None


def _restore_forwards(restores: list) -> None:
    """Call each of `restores` (the bound `restore` / `remove` of what an optimizer installed)."""
    for restore in restores:
        restore()


class _ForgeLinearFn(torch.autograd.Function):
    """y = x Wᵀ + b.  Backward: ΔX with the old W, then the fused update of W (or dW, when unfused).

    `sharded`: under tensor parallelism, the DTensor parameter whose local shard `weight` is (a view without
    autograd history): an input only so that the backward runs (and reaches the update) even where nothing else
    of the layer requires grad; it gets no gradient from here (`_FusedHandle.consume` adds an unfused step's)."""

    @staticmethod
    def forward(ctx, x, weight, bias, handle, sharded=None):
        ctx.save_for_backward(x)
        ctx.handle = handle
        ctx.weight = weight  # not saved through autograd: it is updated in place in backward
        ctx.has_bias = bias is not None
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        weight = ctx.weight
        dx = dy.matmul(weight) if ctx.needs_input_grad[0] else None  # the old weight, before the update
        dbias = _rows(dy).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        dweight = ctx.handle.consume(x, dy)  # after ΔX: the update overwrites the weight
        return dx, dweight, dbias, None, None


class _FusedHandle:
    """Bookkeeping of one fused Linear weight: uses in this step, and the update call. `opt` is the
    ForgeOptimizer (`_fused_update`, `_backward_open`, `_updated_count`), held weakly."""

    def __init__(self, opt, module: torch.nn.Linear, name: str) -> None:
        self.id = next(_HANDLE_IDS)
        _HANDLES[self.id] = self
        self.opt_ref = weakref.ref(opt)
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
        self._consumed: Optional[ConsumedGrad] = None  # the weight's placeholder .grad, made once (no memory)
        self._rows = None  # the step bound by `begin` (a kernels.ParamUpdate), until `finish`

    def note_forward(self) -> None:
        """A forward with gradients through this layer (recomputation inside backward, by checkpointing,
        excluded): counted, or refused where this step's update already ran."""
        if torch._C._current_graph_task_id() != -1:
            return
        if self.updated:
            # Refuse before the next micro-batch's backward can apply a second update.
            opt = self.opt_ref()
            if opt is not None and opt._backward_open:
                raise RuntimeError(_interrupted_message(self.name, *opt._updated_count()))
            raise RuntimeError(_accumulation_message(self.name) + " (This forward, with gradients enabled, "
                               "came after backward and before optimizer.step().)")
        self.forward_uses += 1

    def _consumed_grad(self, weight: torch.Tensor) -> ConsumedGrad:
        """The weight's placeholder `.grad`, made again only where the weight's metadata changed (model.to())."""
        kept = self._consumed
        if kept is None or (kept.shape, kept.dtype, kept.device) != (weight.shape, weight.dtype, weight.device):
            kept = self._consumed = consumed_grad(weight, self.name)
        return kept

    def consume(self, x: torch.Tensor, dy: torch.Tensor) -> Optional[torch.Tensor]:
        """In backward: the fused update of this layer's weight from x [..., K] and dy [..., N] (None), or, where
        it is not fused this step, its dW [N, K] for autograd. A weight sharded by tensor parallelism (x, dy and
        dW this rank's shards) gets an unfused step's dW added to its `.grad` here, as the DTensor of its shard,
        and None is returned: its forward hands autograd only the local shard, which has no gradient edge."""
        opt, weight = self._fused_this_step()
        if opt is None:
            dw = _dw(x, dy, weight)
            if tensor_parallel.is_dtensor(weight):
                tensor_parallel.add_to_grad(weight, dw)
                return None
            return dw
        opt._fused_update(weight, x, dy)
        self._updated(weight)
        return None

    def _fused_this_step(self):
        """(the optimizer, the weight) where this step's update is fused, (None, the weight) where the weight is
        used several times in this step (each use's gradient goes to autograd, summed into .grad); refuses a
        second update in one step."""
        opt = self.opt_ref()
        if opt is None:
            raise RuntimeError(f"the ForgeOptimizer of '{self.name}' no longer exists")
        if self.updated:
            raise RuntimeError(_accumulation_message(self.name))
        if self._rows is not None:  # blocks of an interrupted backward's update were applied
            raise RuntimeError(_interrupted_message(self.name, *opt._updated_count()))
        # Decided per step: a layer called several times in this forward (a shared layer, or a stray forward
        # with grad enabled since the last step) hands each use's dW to autograd, summed into .grad.
        weight = self.weight_ref()
        self.shared = self.forward_uses > 1
        self.bypassed = False
        if isinstance(weight.grad, ConsumedGrad):  # a step's placeholder left by a loop without zero_grad()
            weight.grad = None
        if self.shared:
            return None, weight
        if weight.grad is not None:  # refused before the update: a gradient from another use came first
            raise RuntimeError(f"'{self.name}': " + OUTSIDE_USE_MESSAGE)
        return opt, weight

    def _updated(self, weight: torch.Tensor) -> None:
        self.updated = True
        # what reads .grad from now on (clipping, however imported) learns that it was consumed here
        weight.grad = self._consumed_grad(weight)

    # -- row_updates.RowSink: a weight whose gradient comes in blocks of rows (embeddings, the LM head's loss)
    def begin(self) -> bool:
        """True: this step's update is fused, its blocks of rows come next; False: autograd gets the gradient."""
        opt, weight = self._fused_this_step()
        if opt is None:
            return False
        self._rows = opt._begin_rows_update(weight)
        return True

    def fused_rows(self, x: torch.Tensor, dy: torch.Tensor, r0: int) -> None:
        """Rows [r0, r0 + R) from dW = dyᵀ x: x [T, K], dy [T, R]."""
        self._rows.fused(x, dy, rows=r0, tf32=torch.get_float32_matmul_precision() != "highest")

    def grad_rows(self, grad: torch.Tensor, r0: int) -> None:
        """Rows [r0, r0 + R) from their gradient grad [R, K]."""
        self._rows.from_grad(grad, rows=r0)

    def finish(self) -> None:
        """After the last block: the step's scalar state and counter move, the weight counts as updated."""
        self.close_rows()
        self._updated(self.weight_ref())

    def close_rows(self) -> bool:
        """Complete a begun row update (its scalar state and step counter move); False where none is open.
        `ForgeOptimizer.step()` closes one an interrupted backward left open: its rows handed so far keep
        this step's update, the others went without it."""
        update, self._rows = self._rows, None
        if update is None:
            return False
        opt = self.opt_ref()
        if opt is not None:
            opt._finish_rows_update(self.weight_ref(), update)
        return True


def _interrupted_message(name: str, updated: int, fused: int) -> str:
    return (
        f"'{name}' was already updated in this step: the last backward was interrupted (an exception inside "
        f"backward) after FORGE had applied the update of {updated} of the {fused} fused layers, which keep it "
        f"(their step counters moved). Call optimizer.step() to close the step (it steps no parameter from the "
        f"incomplete gradients that backward left) and optimizer.zero_grad(), then run the batch again."
    )


def _accumulation_message(name: str) -> str:
    return (
        f"'{name}' received a second gradient before optimizer.step(): FORGE already applied this step's "
        f"update inside the first backward, so gradient accumulation over micro-batches (or a second "
        f"backward through the same graph, or a layer called twice inside a reentrant checkpoint) cannot be "
        f"exact. Call optimizer.step() after every backward, or use a larger batch instead of accumulation."
    )


def fused_forward(module: torch.nn.Linear, handle: _FusedHandle, x: torch.Tensor) -> torch.Tensor:
    """The forward of a fused Linear: x [..., K] -> x Wᵀ + b [..., N]."""
    if not (torch.is_grad_enabled() and module.weight.requires_grad):
        return torch.nn.functional.linear(x, module.weight, module.bias)
    if torch.is_autocast_enabled(x.device.type):
        # Otherwise backward fails with an opaque dtype mismatch (bf16 dY against fp32 X and W).
        raise RuntimeError(
            f"'{handle.name}' is updated by FORGE inside backward, which does not support torch.autocast "
            "(mixed precision over float32 weights). Train the model in bfloat16 instead: model.bfloat16() "
            "(FORGE writes bf16 weights with stochastic rounding) without autocast; Hugging Face Trainer "
            "users convert the model and leave TrainingArguments(bf16=False, fp16=False)."
        )
    if tensor_parallel.is_dtensor(module.weight):
        return _sharded_forward(module, handle, x)
    if torch.compiler.is_compiling():
        return torch.ops.forge_dsl.linear(x, module.weight, module.bias, handle.id)
    handle.note_forward()
    return _ForgeLinearFn.apply(x, module.weight, module.bias, handle)


def _sharded_forward(module: torch.nn.Linear, handle: _FusedHandle, x: torch.Tensor) -> torch.Tensor:
    """The forward of a fused Linear whose weight is a DTensor (tensor parallelism): `_ForgeLinearFn` on the local
    shards, its output wrapped as the DTensor the sharding gives (`tensor_parallel.linear_sharding`). Where the
    sharding leaves each rank a partial dW (or under torch.compile), DTensor's own linear runs and the weight is
    stepped from its reduced `.grad`."""
    sharding = tensor_parallel.linear_sharding(x, module.weight)
    if torch.compiler.is_compiling():
        sharding = "under torch.compile a sharded Linear runs DTensor's own linear"
    if isinstance(sharding, str):
        handle.plain_reason = sharding
        return torch.nn.functional.linear(x, module.weight, module.bias)
    handle.plain_reason = None
    handle.note_forward()
    x_local = x.to_local(grad_placements=sharding.x_grad)
    # the shard without autograd history: where the layer is unfused this step, `consume` adds its dW to .grad
    w_local = tensor_parallel.local(module.weight)
    # a bias sharded as the output's columns is added to the local product in one rounding, as F.linear adds it;
    # onto a Partial output (row-parallel) it is added once, as a DTensor
    bias = module.bias
    local_bias = (bias is not None and not sharding.output[0].is_partial() and tensor_parallel.is_dtensor(bias)
                  and tuple(bias.placements) == tuple(module.weight.placements))
    y_local = _ForgeLinearFn.apply(x_local, w_local, bias.to_local() if local_bias else None, handle, module.weight)
    y = tensor_parallel.wrap(y_local, module.weight, sharding.output, (*x.shape[:-1], module.weight.shape[0]))
    return y + bias if bias is not None and not local_bias else y


# ----------------------------------------------------------------------------
# The custom ops, for torch.compile
# ----------------------------------------------------------------------------

_HANDLE_IDS = itertools.count(1)
_HANDLES: "weakref.WeakValueDictionary[int, _FusedHandle]" = weakref.WeakValueDictionary()


# Both ops run host code every call (the forward counts uses; the backward computes the step's host scalars,
# which change every step, and launches the update): a CUDA graph must never capture them, so inductor runs
# them outside its CUDA graphs (mode="reduce-overhead").
_HOST_OPS = (torch.Tag.cudagraph_unsafe,)


@torch.library.custom_op("forge_dsl::linear", mutates_args=(), tags=_HOST_OPS)
def _linear_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], handle: int) -> torch.Tensor:
    """x [..., K] -> x Wᵀ + b [..., N], counted as a forward through the fused layer `handle`."""
    fused = _HANDLES.get(handle)
    if fused is not None:
        fused.note_forward()
    return torch.nn.functional.linear(x, weight, bias)


@_linear_op.register_fake
def _(x, weight, bias, handle):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("forge_dsl::linear_backward", mutates_args=(), tags=_HOST_OPS)
def _linear_backward_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, handle: int,
                        needs_dx: bool) -> torch.Tensor:
    """ΔX = dy [..., N] · W [N, K] with the old weight (empty unless `needs_dx`), then the update of W in place
    (or its dW added to the parameter's `.grad`, where the layer is not fused this step).

    It is registered as an ordered side effect (`_register_effectful_op`), which keeps it in the graph,
    in order, when ΔX is not needed; it declares no mutation of the weight, which the compiler would
    check against the version of every saved copy of the weight (a layer called twice saves it twice,
    and is then stepped from `.grad`, never updated). No node of the backward graph reads the weight after
    this op: the layer's own backward is its last use."""
    dx = dy.matmul(weight) if needs_dx else dy.new_empty(0)
    fused = _HANDLES.get(handle)
    if fused is None or fused.weight_ref() is None:
        raise RuntimeError("a compiled graph calls a fused Linear whose ForgeOptimizer no longer exists; "
                           "call torch._dynamo.reset() (or compile the model again) after detaching or "
                           "dropping the optimizer")
    dw = fused.consume(x, dy)
    if dw is not None:  # not fused this step: autograd's dW, into the parameter's .grad
        tensor_parallel.add_to_grad(fused.weight_ref(), dw)
    return dx


@_linear_backward_op.register_fake
def _(dy, x, weight, handle, needs_dx):
    return dy.new_empty(*dy.shape[:-1], weight.shape[1]) if needs_dx else dy.new_empty(0)


def _dw(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _rows(dy).t().matmul(_rows(x)).to(weight.dtype)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t [..., C] as [tokens, C]; C may be 0 (a Linear without outputs), where reshape(-1, C) cannot infer."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, handle = inputs
    ctx.save_for_backward(x, weight)
    ctx.handle = handle
    ctx.has_bias = bias is not None


def _backward(ctx, dy):
    x, weight = ctx.saved_tensors
    dx = torch.ops.forge_dsl.linear_backward(dy, x, weight, ctx.handle, ctx.needs_input_grad[0])
    dbias = _rows(dy).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return (dx if ctx.needs_input_grad[0] else None), None, dbias, None


_linear_op.register_autograd(_backward, setup_context=_setup_context)
_register_effectful_op(torch.ops.forge_dsl.linear_backward.default, _EffectType.ORDERED)
