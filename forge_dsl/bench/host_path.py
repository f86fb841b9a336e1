"""FORGE's host time per fused Linear update in a training step, on a machine without a GPU.

    TRITON_INTERPRET=1 python -m forge_dsl.bench.host_path [--layers 64] [--width 128] [--steps 30] [--profile]

Trains a stack of `--layers` bias-free bf16 Linears of `--width`² with ForgeOptimizer (AdamW, bf16 state) and
reports the median host time of `ParamStepper.linear` (the whole update a fused Linear's backward runs: keywords,
state, step counter, the reused-launch lookup, host scalars, the launch) over `--steps` steps. The warp-specialized
kernel is made to look available and its launch replaced by no-ops (Triton's launcher, its descriptors and the
kernel: what `tests/kernels/test_reuse.py`'s recorders stand in for), and its size limit lowered so that small
layers take it: what is timed is FORGE's Python around the launch, which the GPU's host runs the same way. One
torch thread, so that the layers' own CPU matmuls leave the measured calls alone. docs/PERF.md, v30.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

import forge_dsl
from forge_dsl.interpreter import interpreting
from forge_dsl.kernels import TileConfig, checks, gluon_lib, policy, reuse, steps
from forge_dsl.training import stepper


class _NoLaunch:
    function, packed_metadata = "function", "packed metadata"

    @staticmethod
    def run(*args) -> None:
        return None


def _stub_the_launch() -> None:
    """The warp-specialized path as on a Hopper GPU, with no-ops for what only a GPU runs."""
    reuse.set_enabled(True)
    reuse.current_stream = lambda device: 0
    steps.check_warp_specialized = lambda *args: None
    steps.WS_MIN_ELEMENTS = 0
    for module in (steps, checks, policy):
        module.hopper_with_gluon = lambda device: True
    gluon_lib.sm_count = lambda device: 132
    gluon_lib.descriptor = lambda t, block: ("descriptor", t.data_ptr())
    # a warp-specialized config of the sizes tests/kernels/test_reuse.py launches
    config = TileConfig(32, 128, 128, num_warps=4, num_stages=2, tma=True, epilogue_split=4, mma_warps=4)
    steps.fused_config = lambda *args, **kwargs: config
    type(gluon_lib.fused_ws).run = lambda self, *args, grid, warmup, **kwargs: _NoLaunch()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--profile", action="store_true", help="and cProfile's top functions over the same steps")
    args = ap.parse_args(argv)
    if not interpreting() or gluon_lib.fused_ws is None:
        ap.error("needs TRITON_INTERPRET=1 (set before Python starts) and a Triton with Gluon")
    torch.set_num_threads(1)
    _stub_the_launch()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width, bias=False)
                                  for _ in range(args.layers)]).bfloat16()
    opt = forge_dsl.ForgeOptimizer(model, "adamw", state_dtype="bf16", lr=1e-4)
    times: list[float] = []
    update = stepper.ParamStepper.linear

    def timed(self, weight, x, dy):
        start = time.perf_counter()
        update(self, weight, x, dy)
        times.append(time.perf_counter() - start)

    stepper.ParamStepper.linear = timed
    x = torch.randn(4, args.width).bfloat16()

    def step():
        model(x).float().sum().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(5):
        step()
    times.clear()
    profiler = cProfile.Profile() if args.profile else None
    if profiler:
        profiler.enable()
    for _ in range(args.steps):
        step()
    if profiler:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
    print(f"launches: {reuse.counts()}")
    print(f"ParamStepper.linear host µs: median {1e6 * statistics.median(times):.1f}, "
          f"10th percentile {1e6 * sorted(times)[len(times) // 10]:.1f} ({len(times)} updates)")


if __name__ == "__main__":
    main()
