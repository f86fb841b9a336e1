"""A fused nn.Embedding: its backward hands the weight's gradient to a `RowSink` one tile of rows at a time.

    y = embedding(ids, weight, sink=sink)      ids [...] (int64 / int32) -> weight[ids] [..., D] (F.embedding)
    embedding_forward(module, ids, sink)       the same for an nn.Embedding, with its options
    fused_embedding_forward(module, handle, ids)   what the optimizer installs as the forward of a module that
                                               `fusion_refusal` accepts: a forward counted by the fused
                                               weight's handle, then `embedding_forward` with it as the sink

Backward, where `sink.begin()` is True: the flattened ids are sorted once (stable; padding tokens sorted past
every row), `OFFSETS` [V + 1] marks where each row's tokens start, and for each tile of rows [r0, r0 + R) one
launch of `kernels.embedding_kernels.rows_grad` writes its gradient block [R, D] in fp32 (each row the fp32 sum of
its tokens' rows of ΔY, zeros where it has none), which goes to `sink.grad_rows(block, r0)`; every tile, in
order, then `sink.finish()`. The whole gradient [V, D] never exists: one workspace of `tile_rows_for(D)` rows,
at most `WORKSPACE_BYTES` (64 MiB; 4096 rows at D = 4096, so Llama-3.1-8B's 128256-row table is 32 tiles,
two launches each), is reused by every tile. A block is valid only inside `grad_rows`: the next tile's launch,
later on the same stream, overwrites it.

Where `sink.begin()` is False (not fused this step) the backward returns torch's dense gradient
(`aten.embedding_backward`, what F.embedding's autograd returns) to autograd.

Exactly as torch: `padding_idx` (that row's tokens contribute nothing; the row is still handed over, as zeros,
and so decays and moves as torch.optim moves it on a zero gradient), `scale_grad_by_freq` (each row's sum
divided by its id's count in the batch). Refused: `max_norm` (the forward renormalizes the rows it reads, in
place) and `sparse=True` (a sparse gradient for a sparse optimizer).

Under `torch.compile` (`torch.compiler.is_compiling()`), with gradients disabled or a frozen weight, the
forward is plain F.embedding: autograd gives the weight its dense `.grad` and the sink is not called.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional

import torch
import torch.nn.functional as F

from ..kernels.checks import check_device
from . import tensor_parallel
from .weight import instance_forward_refusal

__all__ = ["WORKSPACE_BYTES", "embedding", "embedding_forward", "fused_embedding_forward", "fusion_refusal",
           "hand_rows", "tile_rows_for"]

WORKSPACE_BYTES = 64 << 20  # the fp32 gradient block of one tile of rows (docstring above)
TILE_ROW_MULTIPLE = 64
_BLOCK_T = 16  # tokens a program adds per iteration
_MAX_BLOCK_D = 256  # columns per program


def tile_rows_for(dim: int, workspace_bytes: int = WORKSPACE_BYTES) -> int:
    """Rows per tile for an embedding of width `dim`: the most multiple of 64 whose fp32 block [rows, dim] fits
    in `workspace_bytes`, and at least 64 (over the budget only where 64 rows of `dim` are: dim > 2**18)."""
    rows = workspace_bytes // (4 * max(int(dim), 1)) // TILE_ROW_MULTIPLE * TILE_ROW_MULTIPLE
    return max(TILE_ROW_MULTIPLE, rows)


def fusion_refusal(module: torch.nn.Module) -> Optional[str]:
    """Why FORGE does not fuse this module's weight (None: it does, if the weight is trained and not shared).

    Only an nn.Embedding whose forward is nn.Embedding's own is fused: a subclass with its own forward or a
    forward replaced on the instance (by a hook library) would silently lose what it does. `max_norm`
    renormalizes rows in place in the forward and `sparse=True` asks for a sparse gradient: neither is the
    dense update FORGE applies."""
    if not isinstance(module, torch.nn.Embedding):
        return "not an nn.Embedding"
    if type(module).forward is not torch.nn.Embedding.forward:
        return f"{type(module).__qualname__} has its own forward, which FORGE does not replace"
    refusal = instance_forward_refusal(module, also_forge=lambda forward: _is_sink_forward(module, forward))
    if refusal is not None:
        return refusal
    if module.max_norm is not None:
        return _MAX_NORM
    if module.sparse:
        return _SPARSE
    return None


def _is_sink_forward(module: torch.nn.Module, forward: Any) -> bool:
    """Whether an instance-level `forward` is `functools.partial(embedding_forward, module, sink=...)` (a fused
    embedding installed without an optimizer)."""
    return (isinstance(forward, functools.partial) and forward.func is embedding_forward and len(forward.args) == 1
            and forward.args[0] is module and set(forward.keywords) == {"sink"})


_MAX_NORM = ("max_norm renormalizes the rows it reads in place in the forward, which FORGE's update in backward "
             "does not reproduce; use nn.Embedding without max_norm (or leave this weight to step())")
_SPARSE = ("sparse=True makes a sparse gradient for a sparse optimizer (torch.optim.SparseAdam); FORGE applies "
           "a dense update to every row; use sparse=False")


def embedding_forward(module: torch.nn.Embedding, ids: torch.Tensor, sink) -> torch.Tensor:
    """The forward of a fused nn.Embedding: ids [...] -> [..., D], its options as the module's own forward."""
    if tensor_parallel.is_dtensor(module.weight):
        return _sharded_embedding(module, ids, sink)
    return embedding(ids, module.weight, sink=sink, padding_idx=module.padding_idx, max_norm=module.max_norm,
                     norm_type=module.norm_type, scale_grad_by_freq=module.scale_grad_by_freq, sparse=module.sparse)


def fused_embedding_forward(module: torch.nn.Embedding, handle, ids: torch.Tensor) -> torch.Tensor:
    """The forward `installer` gives a fused nn.Embedding: ids [...] -> [..., D]; a forward with gradients is
    counted by `handle` (a `weight.FusedWeight`), which takes the weight's gradient in backward."""
    if torch.is_grad_enabled() and module.weight.requires_grad and not torch.compiler.is_compiling():
        handle.note_forward()
    return embedding_forward(module, ids, handle)


def _sharded_embedding(module: torch.nn.Embedding, ids: torch.Tensor, sink) -> torch.Tensor:
    """The forward of a fused nn.Embedding whose weight is a DTensor (tensor parallelism,
    `tensor_parallel.embedding_sharding`): `embedding` on the local shard, its output wrapped as a DTensor. Rows
    sharded (RowwiseParallel): ids outside this rank's rows read zeros (the output is Partial) and hand no
    gradient. Where the sharding is not one of those, DTensor's own embedding runs and the weight is stepped from
    its `.grad` (`sink.plain_reason` says why)."""
    weight = module.weight
    sharding = tensor_parallel.embedding_sharding(ids, weight)
    if isinstance(sharding, str) or torch.compiler.is_compiling() or not (torch.is_grad_enabled() and
                                                                           weight.requires_grad):
        if isinstance(sharding, str) and hasattr(sink, "plain_reason"):
            sink.plain_reason = sharding
        return F.embedding(ids, weight, module.padding_idx, module.max_norm, module.norm_type,
                           module.scale_grad_by_freq, module.sparse)
    if hasattr(sink, "plain_reason"):
        sink.plain_reason = None
    ids_local = ids.to_local()
    w_local = tensor_parallel.local(weight)  # no autograd history: the gradient goes to `weight` (`sharded`)
    padding_idx, outside = module.padding_idx, None
    if sharding.row_offset is not None:  # rows [row_offset, row_offset + R) of the table live here
        num_rows = w_local.shape[0]
        ids_local = ids_local - sharding.row_offset
        outside = (ids_local < 0) | (ids_local >= num_rows)
        if padding_idx is not None:
            padding_idx = padding_idx % weight.shape[0] - sharding.row_offset
            padding_idx = padding_idx if 0 <= padding_idx < num_rows else None
    out = embedding(ids_local, w_local, sink=sink, padding_idx=padding_idx, max_norm=module.max_norm,
                    norm_type=module.norm_type, scale_grad_by_freq=module.scale_grad_by_freq, sparse=module.sparse,
                    outside=outside, sharded=weight)
    return tensor_parallel.wrap(out, weight, sharding.output, (*ids.shape, weight.shape[1]))


def embedding(ids: torch.Tensor, weight: torch.Tensor, *, sink, padding_idx: Optional[int] = None,
              max_norm: Optional[float] = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
              sparse: bool = False, tile_rows: Optional[int] = None,
              outside: Optional[torch.Tensor] = None, sharded: Optional[torch.Tensor] = None) -> torch.Tensor:
    """weight[ids]: ids [...] int64 or int32, weight [V, D] -> [..., D], as F.embedding; its backward hands the
    weight's gradient to `sink` in fp32 blocks of `tile_rows` rows (default `tile_rows_for(D)`), see the
    module docstring. With gradients disabled, a weight that does not require grad, or under torch.compile:
    F.embedding with these arguments (the sink is not called).

    outside: bool [...] like ids, or None: tokens whose id lies outside this table (another rank's rows, under
    tensor parallelism); their rows of the output are zeros and they hand no gradient. Their ids are ignored.
    sharded: the DTensor parameter whose local shard `weight` is (a view without autograd history), or None: it is
    what requires grad, and a step that is not fused adds its dense gradient to that parameter's `.grad`."""
    grad_of = weight if sharded is None else sharded
    if outside is not None:
        if not isinstance(outside, torch.Tensor) or outside.dtype != torch.bool or outside.shape != ids.shape:
            raise ValueError("outside must be a bool tensor of the ids' shape, or None")
    if not (torch.is_grad_enabled() and grad_of.requires_grad) or torch.compiler.is_compiling():
        if outside is None:
            return F.embedding(ids, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)
        out = F.embedding(ids.masked_fill(outside, 0), weight, padding_idx, max_norm, norm_type, scale_grad_by_freq,
                          sparse)
        return out.masked_fill(outside.unsqueeze(-1), 0)
    if max_norm is not None:
        raise ValueError(f"max_norm={max_norm!r} cannot be fused: " + _MAX_NORM)
    if sparse:
        raise ValueError("sparse=True cannot be fused: " + _SPARSE)
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
        what = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise TypeError(f"ids must be an int64 or int32 tensor, got {what}")
    if weight.dim() != 2 or weight.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"weight must be a 2-D float32 or bfloat16 tensor [V, D] (what FORGE updates), got "
                         f"{weight.dtype} of shape {tuple(weight.shape)}")
    check_device(weight, "weight")
    for method in ("begin", "grad_rows", "finish"):
        if not callable(getattr(sink, method, None)):
            raise TypeError(f"sink must be a forge_dsl.training.row_updates.RowSink (begin, grad_rows, finish); "
                            f"{type(sink).__name__} has no {method}()")
    num_rows = weight.shape[0]
    if padding_idx is not None:
        if isinstance(padding_idx, bool) or not isinstance(padding_idx, int) or not -num_rows <= padding_idx < num_rows:
            raise ValueError(f"padding_idx must be None or an int in [-{num_rows}, {num_rows}) (the weight's rows), "
                             f"got {padding_idx!r}")
        padding_idx %= num_rows
    if tile_rows is None:
        tile_rows = tile_rows_for(weight.shape[1])
    elif isinstance(tile_rows, bool) or not isinstance(tile_rows, int) or tile_rows < 1:
        raise ValueError(f"tile_rows must be a positive int, got {tile_rows!r}")
    return _FusedEmbeddingFn.apply(ids, weight, sink, padding_idx, bool(scale_grad_by_freq), tile_rows, outside,
                                   sharded)


class _FusedEmbeddingFn(torch.autograd.Function):
    """weight[ids].  Backward: the weight's gradient tile by tile into the sink (or its dense gradient, unfused)."""

    @staticmethod
    def forward(ctx, ids, weight, sink, padding_idx, scale_grad_by_freq, tile_rows, outside, sharded):
        ctx.num_rows = weight.shape[0]
        ctx.sharded = sharded
        ctx.any_outside = outside is not None
        if outside is not None:  # ids past every row hand no gradient (as padding tokens do)
            ids = ids.masked_fill(outside, ctx.num_rows)
        ctx.save_for_backward(ids)  # the weight is not saved: the sink updates it in place in backward
        ctx.sink, ctx.padding_idx, ctx.tile_rows = sink, padding_idx, tile_rows
        ctx.scale_grad_by_freq = scale_grad_by_freq
        if outside is None:
            return F.embedding(ids, weight, padding_idx, None, 2.0, scale_grad_by_freq, False)
        out = F.embedding(ids.masked_fill(outside, 0), weight, padding_idx, None, 2.0, scale_grad_by_freq, False)
        return out.masked_fill_(outside.unsqueeze(-1), 0)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        nothing = (None,) * 8
        if not (ctx.needs_input_grad[1] or ctx.needs_input_grad[7]):
            return nothing
        if not ctx.sink.begin():  # not fused this step: the dense gradient, to autograd (or the sharded .grad)
            dense = _dense_grad(grad, ids, ctx.num_rows, ctx.padding_idx, ctx.scale_grad_by_freq, ctx.any_outside)
            if ctx.sharded is None:
                return None, dense, *nothing[2:]
            tensor_parallel.add_to_grad(ctx.sharded, dense)
            return nothing
        hand_rows(ids, grad, ctx.num_rows, ctx.sink, padding_idx=ctx.padding_idx,
                  scale_grad_by_freq=ctx.scale_grad_by_freq, tile_rows=ctx.tile_rows)
        ctx.sink.finish()
        return nothing


def _dense_grad(grad: torch.Tensor, ids: torch.Tensor, num_rows: int, padding_idx: Optional[int],
                scale_grad_by_freq: bool, any_outside: bool) -> torch.Tensor:
    """The dense gradient [num_rows, D] of weight[ids] from ΔY `grad` [..., D]: torch's own
    (`aten.embedding_backward`); with `any_outside`, the tokens whose ids are past every row (`num_rows`: another
    rank's rows) are left out first."""
    padding = -1 if padding_idx is None else padding_idx
    if not any_outside:
        return torch.ops.aten.embedding_backward(grad, ids, num_rows, padding, scale_grad_by_freq, False)
    keep = ids < num_rows
    dim = grad.shape[-1]
    return torch.ops.aten.embedding_backward(grad.reshape(-1, dim)[keep.reshape(-1)], ids[keep], num_rows, padding,
                                             scale_grad_by_freq, False)


def hand_rows(ids: torch.Tensor, grad: torch.Tensor, num_rows: int, sink, *, padding_idx: Optional[int],
              scale_grad_by_freq: bool, tile_rows: int) -> None:
    """Hand `sink.grad_rows(block, r0)` the gradient of every tile of rows [r0, r0 + R) of a weight [num_rows, D]
    (R = `tile_rows`, the last tile ragged), block [R, D] fp32, from ids [...] and ΔY `grad` [..., D]; a
    checked `padding_idx` in [0, num_rows) or None. One workspace [min(tile_rows, num_rows), D] serves all tiles."""
    from ..kernels.embedding_kernels import rows_grad  # triton is imported on first launch
    from ..kernels.kernel_calls import device_guard

    dim = grad.shape[-1]
    grad2 = grad.reshape(-1, dim).contiguous()  # [T, D]
    flat = ids.reshape(-1).to(torch.int64)  # [T]
    if padding_idx is not None:  # past every row: no row sums the padding tokens
        flat = flat.masked_fill(flat == padding_idx, num_rows)
    keys, order = torch.sort(flat, stable=True)  # [T], [T]: token positions grouped by id, each id's in order
    offsets = torch.searchsorted(keys, torch.arange(num_rows + 1, device=keys.device))  # [V + 1]
    block = torch.empty((min(tile_rows, num_rows), dim), dtype=torch.float32, device=grad.device)
    block_d = min(_MAX_BLOCK_D, _next_power_of_2(dim))
    with device_guard(grad):
        for r0 in range(0, num_rows, tile_rows):
            rows = min(tile_rows, num_rows - r0)
            tile = block[:rows]  # [R, D]
            if dim:
                rows_grad[(rows, math.ceil(dim / block_d))](
                    grad2, order, offsets, tile, r0, dim, grad2.stride(0), tile.stride(0),
                    SCALE_BY_FREQ=scale_grad_by_freq, BLOCK_T=_BLOCK_T, BLOCK_D=block_d)
            sink.grad_rows(tile, r0)


def _next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()
