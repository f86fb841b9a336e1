"""Running named checks on each rank of a CPU process group (gloo), for tests/helpers/tp_checks.py and
fsdp_checks.py: `run_on_rank` under torch.multiprocessing (a failure's traceback goes to the parent), `main` under
torchrun (by hand)."""

from __future__ import annotations

import os
import sys
import traceback

import torch.distributed as dist


def run_on_rank(checks: dict, rank: int, world: int, names: list, init: str, tmp: str, errors) -> None:
    """One rank: the process group, then each of `checks` named in `names`, each check(rank, world, tmp); a
    failure's traceback goes to `errors` (by rank)."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        for name in names:
            checks[name](rank, world, tmp)
            dist.barrier()
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def main(checks: dict) -> None:
    """Under torchrun: the checks named on the command line."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    dist.init_process_group("gloo")
    for name in sys.argv[1:]:
        checks[name](dist.get_rank(), dist.get_world_size(), os.environ.get("TMPDIR", "/tmp"))
    dist.destroy_process_group()
