"""`forge-bench model --tp N`: the training step with each model sharded over N GPUs of one host (torchrun).

    torchrun --nproc-per-node N -m forge_dsl.bench model --tp N --models llama3.1-8b,llama3.1-70b \\
        --methods forge-int8,forge-int4,torch-adamw,fsdp2-torch-adamw --checkpointing on

Each rank builds the model on the meta device, shards it there and then materializes only its own shard (a
70B model never exists whole on one GPU):

    every method but fsdp2-*   tensor parallelism on a one-dimensional mesh of the N ranks (`llama_tp_plan`)
    fsdp2-torch-adamw          FSDP2 over the N ranks (`fully_shard` on each decoder layer, then the root) with
                               torch.optim.AdamW(fused=True): the user's alternative, data-parallel sharding
    fsdp2-forge-bf16 / -int8   the same FSDP2 sharding with ForgeOptimizer: each shard updated in backward as
                               FSDP2's reduce-scatter lands its gradient (forge_dsl.training.data_parallel)

Every rank feeds the same tokens (tensor parallelism splits the work of one sequence). Under FSDP2 each rank
feeds its own sequence of that length, so a step processes N sequences: its `tokens_per_s` counts them all.
Each rank measures its own step and memory; rank 0 writes the rows: the peak and the pools of the rank with the
highest peak (per GPU), every rank's peak in `peak_gib_ranks`, and the slowest rank's step time.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch

from ..training import tensor_parallel
from .common import UsageError

__all__ = ["FSDP_METHODS", "Parallel", "gather_row", "init", "llama_tp_plan", "shard"]

FSDP_METHODS = ("fsdp2-torch-adamw", "fsdp2-forge-bf16", "fsdp2-forge-int8")


class Parallel:
    """This rank's place in an N-GPU run: `rank`, `world`, the one-dimensional `mesh` of all ranks."""

    def __init__(self, rank: int, world: int, mesh) -> None:
        self.rank, self.world, self.mesh = rank, world, mesh


def init(tp: int, device: torch.device, option: str = "--tp") -> tuple[Parallel, torch.device]:
    """Join torchrun's process group (NCCL on GPUs, gloo on the CPU) and make the mesh; this rank's device.

    Raises SystemExit where the run was not started by torchrun with N = `tp` processes (the message names the
    command line's `option`, --tp or --fsdp)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = int(os.environ.get("WORLD_SIZE", "0"))
    if world != tp:
        raise SystemExit(f"{option} {tp} runs under torchrun with {tp} processes (torchrun --nproc-per-node {tp} -m "
                         f"forge_dsl.bench model {option} {tp} ...); this process sees WORLD_SIZE={world or 'unset'}")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        if torch.cuda.device_count() < world:
            raise SystemExit(f"{option} {tp}: this host has {torch.cuda.device_count()} GPUs")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Parallel(dist.get_rank(), world, init_device_mesh(device.type, (world,))), device


def llama_tp_plan(model: torch.nn.Module) -> dict:
    """The tensor-parallel plan of a Hugging Face Llama causal LM (module path → ParallelStyle): q, k, v, gate, up
    and the LM head column-parallel, o and down row-parallel, the embedding row-parallel (vocabulary shards), the
    norms replicated (plain parameters: every rank sees the whole hidden state, so each computes their whole
    gradient); each block's output replicated. Not sequence parallel: transformers' decoder takes positions and
    masks from its hidden states' sequence length. Other model types are refused: Qwen3's per-head q/k norms
    would see only a rank's heads, and their replicas would drift apart."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    model_type = getattr(model.config, "model_type", None)
    if model_type not in ("llama", "mistral"):
        raise UsageError(f"--tp has a tensor-parallel plan for Llama-type models, not {model_type!r}")
    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i, _ in enumerate(model.model.layers):
        prefix = f"model.layers.{i}"
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"{prefix}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"{prefix}.{name}"] = RowwiseParallel()
    return plan


def shard(method_name: str, parallel: Parallel) -> Callable[[torch.nn.Module], None]:
    """What shards a meta-device model for `method_name`: FSDP2 for `FSDP_METHODS`, else `llama_tp_plan`."""
    def by_fsdp(model):
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, mesh=parallel.mesh)
        fully_shard(model, mesh=parallel.mesh)

    def by_tp(model):
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, parallel.mesh, llama_tp_plan(model))

    return by_fsdp if method_name in FSDP_METHODS else by_tp


def local_nbytes(t: torch.Tensor) -> int:
    """Bytes this rank holds of `t` (its shard of a DTensor)."""
    return tensor_parallel.local(t).nbytes


def gather_row(row: dict, parallel: Optional[Parallel]) -> Optional[dict]:
    """One row per rank → rank 0's row: the pools of the rank with the highest peak, every rank's peak, the slowest
    rank's step time; None on the other ranks. Without `parallel`, `row` as it is."""
    if parallel is None:
        return row
    import torch.distributed as dist

    rows: list = [None] * parallel.world
    dist.all_gather_object(rows, row)
    if parallel.rank != 0:
        return None
    peaks = [r.get("peak_gib") for r in rows]
    top = max(range(len(rows)), key=lambda i: -1 if peaks[i] is None else peaks[i])
    out = dict(rows[top])
    out["peak_gib_ranks"] = peaks
    times = [r.get("step_ms") for r in rows if r.get("step_ms") is not None]
    if times:
        out["step_ms"] = max(times)
        out["tokens_per_s"] = out["tokens"] / out["step_ms"] * 1e3
    statuses = {r["status"] for r in rows}
    if statuses != {"ok"}:
        out["status"] = "; ".join(sorted(s for s in statuses if s != "ok"))
    return out
