"""ForgeOptimizer under tensor parallelism (PyTorch DTensor), in 2 CPU processes (gloo, the Triton interpreter),
against one process: the checks are in tests/helpers/tp_checks.py (each rank runs one process's model beside its shard
and compares them)."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

WORLD = 2


@contextlib.contextmanager
def one_process_group(tmp_path):
    """A one-rank gloo process group (a one-rank mesh is enough to make DTensors), unless one exists."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()


def run_checks(tmp_path, *names: str) -> None:
    """Spawn WORLD processes that run tp_checks' `names` in order; a failure on any rank fails the test with
    that rank's traceback (the others are stopped)."""
    import torch.multiprocessing as mp

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "helpers"))
    import tp_checks

    errors = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(tp_checks.run, args=(WORLD, list(names), f"file://{tmp_path}/store", str(tmp_path), errors),
                       nprocs=WORLD, start_method="spawn")


@pytest.mark.slow  # 2 processes, about 2 minutes
def test_every_spec_and_layout_matches_one_process(tmp_path):
    """8 specs × fp32 / bf16 weights × fp32 / bf16 / int8 / int4 state on a column- then row-parallel MLP (with
    biases): each rank's weights and decoded states within 1e-5 (max-norm relative) of one process's after two
    steps, every Linear fused on its shard."""
    run_checks(tmp_path, "check_every_spec_and_layout")


@pytest.mark.slow  # 2 processes, about a minute
def test_llama_plan_checkpoints_refusals_and_unfused_paths(tmp_path):
    """torchtitan's Llama plan (sequence parallel norms, vocabulary-parallel embedding, column-parallel head) and
    forge-bench's plan for a Hugging Face Llama (with activation checkpointing) against one process; stochastic rounding per shard; torch.distributed.checkpoint save on 2 ranks and load on
    2 ranks (int8, int4 and mixed state), and one process's state dict loaded into shards; what is refused
    (a shard that splits an int8 block, a 2-D mesh, DDP, FSDP) and what is stepped unfused (FSDP with
    fuse=False, a Linear fed sequence-sharded activations, an embedding and a Linear called twice a step)."""
    run_checks(tmp_path, "check_llama_torchtitan_plan", "check_hf_llama_bench_plan", "check_stochastic_rounding", "check_dcp_round_trip",
               "check_one_process_state_into_shards", "check_refusals", "check_fsdp_unfused_steps_exactly",
               "check_sequence_sharded_input_is_stepped_unfused", "check_layers_called_twice_step_unfused")


def test_lm_head_loss_refuses_a_sharded_head(tmp_path):
    """The loss without logits needs the whole vocabulary on one rank: a DTensor head is refused by name (one
    process: a one-rank mesh is enough to make the head a DTensor)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from forge_dsl import ForgeOptimizer
    from training_models import make_llama

    with one_process_group(tmp_path):
        model = make_llama()
        parallelize_module(model.lm_head, init_device_mesh("cpu", (1,)), ColwiseParallel())
        with pytest.raises(ValueError, match="lm_head is sharded with tensor parallelism"):
            ForgeOptimizer(model, "adamw", lm_head_loss=True)
        assert "forward" not in model.__dict__


@pytest.mark.parametrize("kwargs", [{"max_grad_norm": 1.0}, {"accumulation_steps": 2}])
def test_clipping_and_accumulation_are_refused_with_tensor_parallelism(tmp_path, kwargs):
    """Not built for tensor parallelism (the norm of sharded gradients needs an all-reduce FORGE does not do):
    refused when the optimizer is built, naming fuse=False (one process: a one-rank mesh makes DTensors)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from forge_dsl import ForgeOptimizer
    from training_models import make_mlp

    with one_process_group(tmp_path):
        model = make_mlp()
        parallelize_module(model.up, init_device_mesh("cpu", (1,)), ColwiseParallel())
        with pytest.raises(ValueError, match=r"not supported with tensor parallelism yet \('up\.weight' is a DTensor\)"
                                             r".*fuse=False"):
            ForgeOptimizer(model, "adamw", **kwargs)
        assert "forward" not in model.up.__dict__


@pytest.mark.parametrize("name", ["muon", "lamb"])
def test_specs_in_phases_refuse_sharded_weights(tmp_path, name):
    """A barrier reads the whole weight, which a shard does not hold: a spec in phases (spec/phases.py) refuses
    DTensor parameters when the optimizer is built, before anything is installed (one process, a one-rank mesh)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    from torch import nn

    from forge_dsl import ForgeOptimizer

    with one_process_group(tmp_path):
        model = nn.Sequential(nn.Linear(64, 96, bias=False), nn.Linear(96, 40, bias=False))
        parallelize_module(model[0], init_device_mesh("cpu", (1,)), ColwiseParallel())
        with pytest.raises(ValueError, match=r"runs in phases.*sharded parameters .*not supported with it yet"):
            ForgeOptimizer(model, name)
        assert "forward" not in model[0].__dict__ and "forward" not in model[1].__dict__
