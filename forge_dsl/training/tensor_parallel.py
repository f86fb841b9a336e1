"""FORGE on models parallelized with PyTorch's DTensor (`torch.distributed.tensor.parallel`).

    mesh = init_device_mesh("cuda", (tp,))
    parallelize_module(model, mesh, plan)          # ColwiseParallel, RowwiseParallel, SequenceParallel, ...
    opt = forge_dsl.ForgeOptimizer(model, "adamw", lr=3e-4)

Tensor (and sequence) parallelism keeps FORGE exact: each rank's shard of a weight sees its complete gradient,
so the fused update runs on the local shard. What each placement of a fused nn.Linear [N, K] means, on a
one-dimensional mesh (`linear_sharding`):

    weight Shard(0)   (ColwiseParallel)  input Replicate    dW rows = dy_localᵀ x        output Shard(-1)
    weight Shard(1)   (RowwiseParallel)  input Shard(-1)    dW cols = dyᵀ x_local        output Partial
    weight Replicate                     input Replicate    dW = dyᵀ x on every rank     output Replicate

Any other input (a token dimension sharded, as a sequence-parallel region feeds it) makes each rank's dW a
partial sum: that layer runs DTensor's own linear for the step and its weight is stepped from `.grad` after
the reduction, and `describe()` says so. An nn.Embedding is fused with its weight sharded by rows (vocabulary,
RowwiseParallel: ids outside the rank's rows read zeros and hand no gradient) or by columns (ColwiseParallel),
or replicated (`embedding_sharding`).

Parameters left to `step()` (norms, biases) are stepped on their local shard from their gradient
redistributed to the parameter's placements (`local_grad`): a replicated norm weight under SequenceParallel
has a Partial gradient, which is all-reduced first.

State stays local: each state tensor (and int8 / int4 block scales) is the local shard's, created from the
layout the global shape resolves to (`state_layouts`), so every rank's codes and scales are slices of what one
process would hold. `ForgeOptimizer.state_dict()` hands them out as DTensors of the parameter's mesh
(`global_state`), which torch.distributed.checkpoint saves sharded; `load_state_dict` takes them back
(`local_state`: a DTensor redistributed to this rank's shard, or a whole tensor cut to it). A quantized state
of a parameter sharded along its last dim needs every shard to start on a 64-column block
(`quantized_sharding_refusal`), refused otherwise when the optimizer is built.

Refused with the reason (`data_parallel_refusal`), for fusing: DistributedDataParallel, FSDP (`fully_shard` or
FullyShardedDataParallel) and meshes of more than one dimension (a data-parallel dimension), where each rank
holds a partial gradient that must be reduced before any update. A model with FSDP2 modules passed to
`ForgeOptimizer` itself is not fused but has each shard updated as its reduced gradient lands
(forge_dsl/training/data_parallel.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from ..kernels.layouts import BLOCK, FOUR_BIT_LAYOUTS, StateLayout, is_quantized, n_blocks, rows_cols, storage_shape

try:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
except ImportError:  # a torch build without torch.distributed: no DTensor can reach FORGE
    DTensor = Partial = Replicate = Shard = None

__all__ = ["DTensor", "LinearSharding", "add_to_grad", "data_parallel_refusal", "embedding_sharding", "global_layouts",
           "global_state", "is_dtensor", "is_fsdp2", "linear_sharding", "local", "local_grad", "local_state", "mesh_refusal",
           "quantized_sharding_refusal", "shard_index", "state_layouts", "wrap"]


def is_dtensor(t: Any) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view of its storage, without autograd history); any other tensor as
    it is."""
    if is_dtensor(t):
        with torch.no_grad():
            return t.to_local()
    return t


def local_grad(p: torch.Tensor) -> torch.Tensor:
    """The local shard of `p.grad` laid out as `p` is (a Partial gradient all-reduced, a replicated parameter's
    gradient sharded as the parameter is): what the element-wise update of the local shard of `p` reads."""
    grad = p.grad
    if is_dtensor(p) and is_dtensor(grad):
        if tuple(grad.placements) != tuple(p.placements):
            grad = grad.redistribute(p.device_mesh, p.placements)
        return grad.to_local()
    return grad


def shard_index(p: torch.Tensor) -> Optional[int]:
    """Which shard of `p` this rank holds (its coordinate on a one-dimensional mesh), or None where every rank
    holds the same values (a plain tensor, or a replicated DTensor): ranks with different shards draw
    different stochastic-rounding bits, replicas the same."""
    if not is_dtensor(p) or not any(pl.is_shard() for pl in p.placements):
        return None
    coordinate = p.device_mesh.get_coordinate()
    return None if coordinate is None else int(coordinate[0])


# ----------------------------------------------------------------------------
# What FORGE refuses
# ----------------------------------------------------------------------------


def data_parallel_refusal(model: torch.nn.Module) -> Optional[str]:
    """Why FORGE cannot fuse the update of `model`'s weights under data parallelism, or None."""
    why = None
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        why = "DistributedDataParallel"
    else:
        for module in model.modules():
            name = type(module).__name__
            if "FullyShardedDataParallel" in name or is_fsdp2(module):
                why = f"FSDP ({name})"
                break
    if why is None:
        return None
    return (f"FORGE cannot fuse the update into backward under data parallelism ({why}): each rank would update its "
            "weights from its own partial gradient, before the reduction across ranks. Shard the model with FSDP2 "
            "(torch.distributed.fsdp.fully_shard) and pass the model itself, ForgeOptimizer(model, ...), which "
            "then updates each shard in backward as its reduced gradient lands; or build the optimizer with "
            "fuse=False (every parameter stepped in step() from its reduced gradient, exactly); or shard the model "
            "with tensor/sequence parallelism (torch.distributed.tensor.parallel.parallelize_module), under which "
            "FORGE fuses.")


def is_fsdp2(module: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(module, FSDPModule)


def mesh_refusal(p: torch.Tensor, name: str) -> Optional[str]:
    """Why the fused update cannot run on DTensor `p`'s shard, or None: only one-dimensional (tensor-parallel)
    meshes; another dimension is data parallelism, whose gradients are partial sums."""
    if not is_dtensor(p) or p.device_mesh.ndim == 1:
        return None
    return (f"'{name}' is a DTensor on a {p.device_mesh.ndim}-dimensional device mesh {tuple(p.device_mesh.shape)}: "
            "a mesh dimension beside tensor parallelism (data parallelism, HSDP) leaves each rank a partial gradient, "
            "which must be reduced before any update, so the update cannot be fused into backward. Parallelize "
            "the model over a one-dimensional tensor-parallel mesh, or build the optimizer with fuse=False.")


def _shards(size: int, parts: int) -> list[tuple[int, int]]:
    """(offset, length) of each of `parts` shards of a dimension of `size`, as DTensor's Shard cuts it
    (torch.chunk: ceil(size / parts) each, the last ones shorter or empty)."""
    chunk = -(-size // parts) if parts else 0
    return [(min(i * chunk, size), max(0, min(size, (i + 1) * chunk) - min(i * chunk, size))) for i in range(parts)]


def quantized_sharding_refusal(p: torch.Tensor, layouts: Sequence[StateLayout], name: str) -> Optional[str]:
    """Why the block-quantized `layouts` (int8 / int4 state of DTensor `p`) cannot be held shard by shard, or
    None. Each rank's state must be a slice of what one process holds: blocks of 64 along the last dim, so a
    shard of the last dim must start on a block (and a 4-bit one hold 0 or at least 64 columns, so its packed
    codes read as 4-bit); sharding by rows splits no block, but rows of a parameter with more than two dims are
    flattened (their scales could not be cut as DTensor cuts the codes)."""
    quantized = [layout for layout in layouts if is_quantized(layout)]
    if not is_dtensor(p) or not quantized:
        return None
    last = p.dim() - 1
    for mesh_dim, placement in enumerate(p.placements):
        if not placement.is_shard():
            continue
        dim = placement.dim % p.dim()
        fix = (" Choose a sharding degree (the tensor-parallel or FSDP2 mesh's size) that cuts it into multiples of 64 "
               "columns, or build the optimizer with state_dtype 'bf16' or 'fp32' (or a dict naming those for its "
               "quantized states).")
        if dim != last and not (dim == 0 and p.dim() == 2):
            return (f"'{name}' is sharded along dim {dim} of its {p.dim()} dims, which int8 / int4 state cannot "
                    "follow: its block scales cover rows of the last dim flattened across the leading dims." + fix)
        if dim != last:
            continue
        if p.device_mesh.ndim != 1:
            return (f"'{name}' is sharded along its last dim on a {p.device_mesh.ndim}-dimensional mesh: int8 / int4 "
                    "state follows a last-dim shard on one-dimensional meshes only." + fix)
        for offset, length in _shards(p.shape[last], p.device_mesh.size(mesh_dim)):
            if length and offset % BLOCK:
                return (f"'{name}' [{', '.join(map(str, p.shape))}] is sharded along its last dim into shards of "
                        f"{_shards(p.shape[last], p.device_mesh.size(mesh_dim))[0][1]} columns, which splits a block "
                        "of 64 of its int8 / int4 state (a shard starts at column "
                        f"{offset}): every rank's blocks must be whole blocks of the unsharded state." + fix)
            if length and length < BLOCK and any(layout in FOUR_BIT_LAYOUTS for layout in quantized):
                return (f"'{name}' is sharded along its last dim with a shard of {length} columns: int4 state needs "
                        "0 or at least 64 columns per shard." + fix)
    return None


# ----------------------------------------------------------------------------
# A fused Linear or Embedding on local shards
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class LinearSharding:
    """How y = x Wᵀ runs on local shards: the placements of x's gradient that the local ΔX = ΔY_local W_local
    has, and of the output that x_local W_localᵀ has."""

    x_grad: tuple
    output: tuple


def linear_sharding(x: Any, weight: torch.Tensor) -> Union[LinearSharding, str]:
    """The sharding of a fused Linear with DTensor `weight` [N, K] (one-dimensional mesh) and input `x`
    [..., K], or why its update cannot be fused this step (each rank's dW would be a partial sum)."""
    if not is_dtensor(x):
        return "its input is not a DTensor (torch's own linear refuses a plain input with a DTensor weight too)"
    if x.device_mesh != weight.device_mesh or x.device_mesh.ndim != 1:
        return "its input lives on another device mesh than its weight"
    (pw,), (px,) = weight.placements, x.placements
    last = x.dim() - 1
    if pw.is_shard() and pw.dim % 2 == 0 and px.is_replicate():
        return LinearSharding((Partial(),), (Shard(last),))
    if pw.is_shard() and pw.dim % 2 == 1 and px.is_shard() and px.dim % x.dim() == last:
        return LinearSharding((Shard(last),), (Partial(),))
    if pw.is_replicate() and px.is_replicate():
        return LinearSharding((Replicate(),), (Replicate(),))
    return (f"its input is {px} with its weight {pw}: each rank's dW would be a partial sum over its tokens, reduced "
            "across ranks only after backward; DTensor's linear ran and the weight was stepped from its reduced .grad")


def add_to_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """`param.grad += grad` as autograd accumulates a gradient (the first one taken as it is), for a fused layer's
    unfused step, which hands its dW outside autograd; for a DTensor `param`, `grad` is this rank's shard of it."""
    if is_dtensor(param):
        grad = wrap(grad.to(param.dtype), param, tuple(param.placements), param.shape)
    with torch.no_grad():
        if param.grad is None:
            param.grad = grad
        else:
            param.grad += grad


def wrap(local_out: torch.Tensor, like: torch.Tensor, placements: tuple, shape: Sequence[int]) -> torch.Tensor:
    """The DTensor of global `shape` on `like`'s mesh whose local shard is `local_out` (differentiable: its
    gradient comes back as the local shard of a gradient redistributed to `placements`)."""
    shape = torch.Size(shape)
    return DTensor.from_local(local_out, like.device_mesh, placements, run_check=False, shape=shape,
                              stride=_contiguous_stride(shape))


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(tuple(shape)):
        stride.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(stride))


@dataclass(frozen=True)
class EmbeddingSharding:
    """An embedding's local rows: the first global row of this rank's shard and how many it holds (rows
    sharded), or None (all rows); the output's placements."""

    row_offset: Optional[int]
    output: tuple


def embedding_sharding(ids: Any, weight: torch.Tensor) -> Union[EmbeddingSharding, str]:
    """How a fused nn.Embedding with DTensor `weight` [V, D] runs on its local shard, or why it cannot be fused."""
    if not is_dtensor(ids) or not ids.placements[0].is_replicate():
        return "its ids are not a replicated DTensor (as ColwiseParallel / RowwiseParallel hand an embedding)"
    if ids.device_mesh != weight.device_mesh or weight.device_mesh.ndim != 1:
        return "its ids live on another device mesh than its weight"
    (pw,) = weight.placements
    if pw.is_shard() and pw.dim % 2 == 0:
        coordinate = weight.device_mesh.get_coordinate()
        offset, _ = _shards(weight.shape[0], weight.device_mesh.size(0))[coordinate[0]]
        return EmbeddingSharding(offset, (Partial(),))
    if pw.is_shard() and pw.dim % 2 == 1:
        return EmbeddingSharding(None, (Shard(ids.dim()),))
    if pw.is_replicate():
        return EmbeddingSharding(None, (Replicate(),))
    return f"its weight is {pw}"


# ----------------------------------------------------------------------------
# State: local shards inside, DTensors in state dicts
# ----------------------------------------------------------------------------


def global_layouts(spec, p: torch.Tensor, state_dtype) -> dict[str, StateLayout]:
    """Each state's layout for DTensor `p` as its global shape resolves it (what one process holds)."""
    from ..api import state_layout
    from ..kernels.layouts import resolve_layout

    return {s.name: resolve_layout(state_layout(spec, s, state_dtype), s.nonneg, p.shape) for s in spec.states}


def state_layouts(spec, p: torch.Tensor, state_dtype) -> dict:
    """`init_state`'s `layout` argument for the local shard of DTensor `p`: `global_layouts` (a shard narrower
    than a block would otherwise stay fp32 where one process quantizes)."""
    return {name: layout if is_quantized(layout) else layout.layout_name
            for name, layout in global_layouts(spec, p, state_dtype).items()}


def _scale_placements(p: torch.Tensor) -> tuple:
    """The placements of block scales [rows, n_blocks] of a state of DTensor `p` (`quantized_sharding_refusal`
    allows a last-dim shard, and a row shard of a 2-D parameter)."""
    last = p.dim() - 1
    out = []
    for pl in p.placements:
        if pl.is_shard():
            out.append(Shard(1) if pl.dim % p.dim() == last else Shard(0))
        else:
            out.append(pl)
    return tuple(out)


def _global_shape(p: torch.Tensor, key: str, layouts: Mapping[str, StateLayout]) -> torch.Size:
    """The shape of state entry `key` (a state or its '.scale') of DTensor `p` as one process holds it."""
    if key.endswith(".scale"):
        rows, cols = rows_cols(p.shape)
        return torch.Size((rows, n_blocks(cols)))
    return torch.Size(storage_shape(layouts[key], p.shape))


def global_state(p: torch.Tensor, state: Mapping[str, Any], layouts: Mapping[str, StateLayout]) -> dict:
    """`state` of DTensor `p` with each per-element state and scale as a DTensor of `p`'s mesh whose local shard
    is the tensor this rank holds (they share storage), `layouts` from `global_layouts`; 0-dim entries (step,
    seed, scalar states: the same on every rank) as they are."""
    out = {}
    for key, t in state.items():
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or is_dtensor(t):
            out[key] = t
            continue
        placements = _scale_placements(p) if key.endswith(".scale") else tuple(p.placements)
        shape = _global_shape(p, key, layouts)
        out[key] = DTensor.from_local(t, p.device_mesh, placements, run_check=False, shape=shape,
                                      stride=_contiguous_stride(shape))
    return out


def local_state(p: torch.Tensor, key: str, t: torch.Tensor) -> torch.Tensor:
    """A checked state entry of DTensor `p` as this rank holds it: a DTensor redistributed to `p`'s shard
    (what `global_state` made, or a checkpoint's resharded by torch.distributed.checkpoint), or a whole
    tensor (one process's state) cut to it; 0-dim entries as they are."""
    if t.dim() == 0:
        return t
    placements = _scale_placements(p) if key.endswith(".scale") else tuple(p.placements)
    if not is_dtensor(t):
        t = DTensor.from_local(t, p.device_mesh, [Replicate()] * p.device_mesh.ndim, run_check=False)
    if tuple(t.placements) != placements:
        t = t.redistribute(p.device_mesh, placements)
    return t.to_local().contiguous()

