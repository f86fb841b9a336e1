"""`forge-bench model` with every OffloadActivations' max_in_flight_bytes set to FORGE_IN_FLIGHT_MIB MiB: what the
bound on copies in flight costs (PERF v22).

    FORGE_IN_FLIGHT_MIB=256 python -m forge_dsl.bench.offload_in_flight model --models llama3.1-8b --seq 8192 \
        --checkpointing on --offload both --methods forge-int8
"""

from __future__ import annotations

import os
import sys
from typing import Optional, Sequence

from forge_dsl.training import offload

from . import __main__ as bench_main


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`forge-bench` with argv, OffloadActivations' bound on copies in flight set from FORGE_IN_FLIGHT_MIB."""
    mib = os.environ.get("FORGE_IN_FLIGHT_MIB")
    if mib is None:
        raise SystemExit("forge_dsl.bench.offload_in_flight reads the bound from FORGE_IN_FLIGHT_MIB: set it to a "
                         "number of MiB (FORGE_IN_FLIGHT_MIB=256 python -m forge_dsl.bench.offload_in_flight "
                         "model ...)")
    limit = int(mib) << 20
    init = offload.OffloadActivations.__init__
    offload.OffloadActivations.__init__ = lambda self, *a, **k: init(self, *a, **{**k, "max_in_flight_bytes": limit})
    return bench_main.main(argv)


if __name__ == "__main__":
    sys.exit(main())
