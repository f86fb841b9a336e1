"""ForgeOptimizer under FSDP2 data parallelism (`fully_shard`), in 2 and 4 CPU processes (gloo, the Triton
interpreter), against one process's torch AdamW on the whole batch: the checks are in tests/helpers/fsdp_checks.py."""

from __future__ import annotations

import pytest

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)


def run_checks(tmp_path, world: int, *names: str) -> None:
    """Spawn `world` processes that run fsdp_checks' `names` in order; a failure on any rank fails the test."""
    import torch.multiprocessing as mp

    import fsdp_checks

    errors = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(fsdp_checks.run, args=(world, list(names), f"file://{tmp_path}/store", str(tmp_path), errors),
                       nprocs=world, start_method="spawn")


def test_two_processes(tmp_path):
    """Plain, clipped, accumulated (k = 2, 3) and both, against torch; each shard updated inside backward; a
    second backward refused; HSDP refused."""
    run_checks(tmp_path, 2, "check_against_torch", "check_updated_in_backward", "check_second_backward_is_refused",
               "check_leftover_micro_batches_and_in_place_zeroing", "check_two_dimensional_mesh_is_refused")


@pytest.mark.slow  # 4 processes
def test_four_processes(tmp_path):
    run_checks(tmp_path, 4, "check_against_torch", "check_updated_in_backward", "check_two_dimensional_mesh_is_refused")


@pytest.mark.slow
def test_state_layouts_and_checkpoints(tmp_path):
    """bf16 / int8 / int4 state per shard (a shard that would split a block refused), and a sharded state dict
    through torch.distributed.checkpoint."""
    run_checks(tmp_path, 2, "check_state_layouts", "check_quantized_state_that_a_shard_would_split_is_refused",
               "check_dcp_round_trip")
