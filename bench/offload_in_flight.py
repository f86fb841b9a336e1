"""`forge-bench model` with every OffloadActivations' max_in_flight_bytes set to FORGE_IN_FLIGHT_MIB MiB: what the
bound on copies in flight costs (PERF v22).

    FORGE_IN_FLIGHT_MIB=256 python bench/offload_in_flight.py model --models llama3.1-8b --seq 8192 \
        --checkpointing on --offload both --methods forge-int8
"""
import os
import sys

from forge_dsl.training import offload
from forge_dsl.bench import __main__ as bench_main

limit = int(os.environ["FORGE_IN_FLIGHT_MIB"]) << 20
init = offload.OffloadActivations.__init__
offload.OffloadActivations.__init__ = lambda self, *a, **k: init(self, *a, **{**k, "max_in_flight_bytes": limit})
sys.exit(bench_main.main())
