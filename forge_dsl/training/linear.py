"""A fused nn.Linear: the forward whose backward runs FORGE's update of the weight.

    y = fused_forward(module, handle, x)     y = x Wᵀ + b [..., N]; backward: ΔX [..., K] with the old W [N, K],
                                             then the fused update of W and its state (`FusedWeight.consume`)

Two entry points reach the same code (`FusedWeight.note_forward`, `FusedWeight.consume`):

* eager: `_ForgeLinearFn`, an autograd.Function (the fewest host µs per call);
* under `torch.compile` (`torch.compiler.is_compiling()`): the torch custom ops `forge_dsl::linear` and
  `forge_dsl::linear_backward`, whose registered autograd calls the second from the first's backward. Both
  are opaque to the compiler, so a compiled model has no graph break from FORGE (`fullgraph=True` works)
  and computes what eager computes. A layer's handle reaches them as an int (`weight.handle_by_id`).

The backward path of a layer that is not fused this step (called several times in one forward, or whose
optimizer is gone) hands its dW to autograd in eager mode, and under compile adds it to `weight.grad`
itself (the ops' signature is static), as autograd would.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

from . import tensor_parallel
from .weight import FusedWeight, handle_by_id, instance_forward_refusal, rows_of

__all__ = ["fused_forward", "linear_refusal"]


def linear_refusal(module: torch.nn.Linear) -> Optional[str]:
    """Why FORGE does not fuse this nn.Linear's weight (None: it does, if the weight is trained and not shared).

    Only an nn.Linear whose forward is nn.Linear's own is fused: a subclass with its own forward
    (`torch.ao.nn.qat.Linear`'s fake quantization, a scaled output) or a forward replaced on the instance (by
    a hook library) would silently lose what it does. nn.MultiheadAttention reads its out_proj's weight
    directly, never through out_proj's forward."""
    if isinstance(module, torch.nn.modules.linear.NonDynamicallyQuantizableLinear):
        return "read directly by nn.MultiheadAttention"
    if type(module).forward is not torch.nn.Linear.forward:
        return f"{type(module).__qualname__} has its own forward, which FORGE does not replace"
    return instance_forward_refusal(module)


class _ForgeLinearFn(torch.autograd.Function):
    """y = x Wᵀ + b.  Backward: ΔX with the old W, then the fused update of W (or dW, when unfused).

    `sharded`: under tensor parallelism, the DTensor parameter whose local shard `weight` is (a view without
    autograd history): an input only so that the backward runs (and reaches the update) even where nothing else
    of the layer requires grad; it gets no gradient from here (`FusedWeight.consume` adds an unfused step's)."""

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
        dbias = rows_of(dy).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        dweight = ctx.handle.consume(x, dy)  # after ΔX: the update overwrites the weight
        return dx, dweight, dbias, None, None


def fused_forward(module: torch.nn.Linear, handle: FusedWeight, x: torch.Tensor) -> torch.Tensor:
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


def _sharded_forward(module: torch.nn.Linear, handle: FusedWeight, x: torch.Tensor) -> torch.Tensor:
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

# Both ops run host code every call (the forward counts uses; the backward computes the step's host scalars,
# which change every step, and launches the update): a CUDA graph must never capture them, so inductor runs
# them outside its CUDA graphs (mode="reduce-overhead").
_HOST_OPS = (torch.Tag.cudagraph_unsafe,)


@torch.library.custom_op("forge_dsl::linear", mutates_args=(), tags=_HOST_OPS)
def _linear_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], handle: int) -> torch.Tensor:
    """x [..., K] -> x Wᵀ + b [..., N], counted as a forward through the fused layer `handle`."""
    fused = handle_by_id(handle)
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
    fused = handle_by_id(handle)
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


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, handle = inputs
    ctx.save_for_backward(x, weight)
    ctx.handle = handle
    ctx.has_bias = bias is not None


def _backward(ctx, dy):
    x, weight = ctx.saved_tensors
    dx = torch.ops.forge_dsl.linear_backward(dy, x, weight, ctx.handle, ctx.needs_input_grad[0])
    dbias = rows_of(dy).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return (dx if ctx.needs_input_grad[0] else None), None, dbias, None


_linear_op.register_autograd(_backward, setup_context=_setup_context)
_register_effectful_op(torch.ops.forge_dsl.linear_backward.default, _EffectType.ORDERED)
# Inductor reads the cudagraph_unsafe tag off a node's target, and an effectful op's node is the `with_effects`
# wrapper around it: without its name here, mode="reduce-overhead" records the update into a CUDA graph (where
# `ParamStepper` refuses it), instead of running it between the graphs.
PARTITION_OPS = ("forge_dsl::linear", "forge_dsl::linear_backward")


def _partition_on_host_ops() -> None:
    """Ask inductor to cut its CUDA graphs at FORGE's ops (`torch._inductor.config.custom_should_partition_ops`,
    where this torch has it)."""
    from torch._inductor import config as inductor_config

    ops = getattr(inductor_config, "custom_should_partition_ops", None)
    if ops is None:  # an older torch: a captured update is refused at its first step
        return
    ops.extend(name for name in PARTITION_OPS if name not in ops)


_partition_on_host_ops()
