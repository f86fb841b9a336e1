"""Who waits for whom in the warp-specialized fused kernel: a per-tile timeline of each partition (docs/PERF.md, v12e).

It launches the product kernel, `gluon_lib.fused_ws`, with a timeline buffer (its TIMELINE constexpr > 0,
which compiles in `%clock64` stamps at each barrier wait of its three partitions; the product's launches
compile none of it), written to TL [programs, tiles, SLOTS] int64. A program's partitions share one SM,
so its stamps share one clock. Per tile j of a program:

  mma       0 loop start, 1 cycles waiting for ring buffers (summed over the token blocks), 2 loop end,
            3 acc_smem free (the epilogue has read tile j - 1), 4 tile j handed over (stored, signalled)
  epilogue  5 before waiting for tile j (with the prefetch, the first slice's loads already out), 6 tile j
            ready, 7 tile j done
  loader    8 cycles waiting for free ring buffers during tile j (summed)
  clocks    9 `%globaltimer` (ns) beside slot 0, 10 beside slot 7: cycles over nanoseconds give the SM clock

    python -m forge_dsl.bench.ws_timeline --shapes 4096x4096,14336x4096 --tokens 512,2048 [--config 64,128,128,8,5,split=4,ws=8]

Prints, per case, the mean over programs and over tiles after each program's first: the tile period and
where it goes, in µs at the SM clock measured by the same run (cycles over elapsed time of a timed call).
Checks first that the recording kernel writes the same bits as `fused_linear_step` with the same config.
Scratch tensors only; needs a Hopper GPU with Gluon (Triton >= 3.6).
"""

from __future__ import annotations

import argparse

import torch

import forge_dsl
from forge_dsl.kernels import TileConfig
from forge_dsl.kernels.gluon_lib import TIMELINE_SLOTS, sm_count
from forge_dsl.kernels.steps import ParamUpdate, fused_linear_step
from forge_dsl.kernels.kernel_calls import launch_warp_specialized, triton_cdiv
from forge_dsl.kernels.policy import fused_config, hopper_with_gluon

SLOTS = int(TIMELINE_SLOTS.value if hasattr(TIMELINE_SLOTS, "value") else TIMELINE_SLOTS)


def launch(x, dy, weight, state, cfg: TileConfig, *, step: int, seed: int, timeline: torch.Tensor, **hypers):
    """One launch of `gluon_lib.fused_ws` recording `timeline` [programs, tiles, SLOTS] int64 (in place).

    x [T, K], dy [T, N] bf16; weight [N, K] bf16; state: AdamW's."""
    update = ParamUpdate("adamw", weight, state, step=step, seed=seed, **hypers)
    launch_warp_specialized(cfg, x, dy, weight.view(torch.int16), True, update.states, update.update, update.exports,
                            update.key, "stochastic", timeline=timeline)
    update.commit()


def summarize(tl_cycles: torch.Tensor, tiles_per_program: list[int], ghz: float) -> dict[str, float]:
    """Mean µs per tile, over programs and their tiles after the first, of the period and its parts.

    tl_cycles [programs, tiles, SLOTS] int64 as `gluon_lib.fused_ws` recorded it (see the module docstring); a program's
    tiles past tiles_per_program[p] are unused. "mma after hand-over" (the MMA warps' own slices, until the
    next tile's loop starts) needs a next tile, so it leaves out each program's last."""
    parts: dict[str, list[float]] = {}

    def add(name: str, cycles) -> None:
        parts.setdefault(name, []).append(float(cycles))

    for p, n in enumerate(tiles_per_program):
        t = tl_cycles[p, :n].double()
        for j in range(1, n):
            add("period", t[j, 0] - t[j - 1, 0])
            add("loop", t[j, 2] - t[j, 0])
            add("loop: ring waits", t[j, 1])
            add("mma waits for acc_smem", t[j, 3] - t[j, 2])
            add("hand-over store", t[j, 4] - t[j, 3])
            if j + 1 < n:
                add("mma after hand-over", t[j + 1, 0] - t[j, 4])
            add("epilogue waits for tile", t[j, 6] - t[j, 5])
            add("epilogue busy", t[j, 7] - t[j, 6])
            add("loader ring-full waits", t[j, 8])
    return {name: sum(v) / len(v) / (ghz * 1e3) for name, v in parts.items()}


def _time(call, calls: int = 5) -> float:
    """Mean ms of `calls` calls queued behind a GPU sleep, so the host's launch time is not in it."""
    call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(5_000_000)  # a few ms of GPU time while the host queues the calls
    start.record()
    for _ in range(calls):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m forge_dsl.bench.ws_timeline", description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="4096x4096,14336x4096", help="NxK,... (default: q/o and gate/up)")
    ap.add_argument("--tokens", default="512,2048", help="T,... (default: 512,2048)")
    ap.add_argument("--config", help="tile config (default: fused_config's)")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not hopper_with_gluon(torch.device("cuda")):
        raise SystemExit("forge_dsl.bench.ws_timeline times the warp-specialized kernel: it needs a Hopper GPU (sm_90) "
                         "and a Triton with Gluon (>= 3.6)")
    dev = torch.device("cuda")
    programs_max = sm_count(dev)
    for shape in args.shapes.split(","):
        N, K = (int(v) for v in shape.lower().split("x"))
        for T in (int(v) for v in args.tokens.split(",")):
            cfg = TileConfig.parse(args.config) if args.config else fused_config(T, N, K, dev)
            g = torch.Generator(device=dev).manual_seed(0)
            x = torch.randn(T, K, device=dev, generator=g).bfloat16()
            dy = (torch.randn(T, N, device=dev, generator=g) * 1e-3).bfloat16()
            w = (torch.randn(N, K, device=dev, generator=g) * 0.02).bfloat16()
            state = forge_dsl.init_state("adamw", w, layout="bf16")
            tiles = triton_cdiv(N, cfg.block_n) * triton_cdiv(K, cfg.block_k)
            programs = min(programs_max, tiles)
            per_program = [len(range(p, tiles, programs)) for p in range(programs)]
            timeline = torch.zeros(programs, max(per_program), SLOTS, dtype=torch.int64, device=dev)
            # the same bits as the product kernel, from the same state
            w2, state2 = w.clone(), {k: v.clone() for k, v in state.items()}
            launch(x, dy, w, state, cfg, step=1, seed=5, timeline=timeline, lr=1e-3)
            fused_linear_step("adamw", x, dy, w2, state2, step=1, seed=5, config=cfg, lr=1e-3)
            same = torch.equal(w.view(torch.int16), w2.view(torch.int16)) and all(
                torch.equal(state[k].view(torch.int16), state2[k].view(torch.int16)) for k in state)
            # timed calls; the timeline left is the last call's
            ms = _time(lambda: launch(x, dy, w, state, cfg, step=3, seed=5, timeline=timeline, lr=1e-3))
            ms_product = _time(lambda: fused_linear_step("adamw", x, dy, w2, state2, step=3, seed=5, config=cfg,
                                                         lr=1e-3))
            cyc = timeline.cpu()
            ghz = sum(float(cyc[p, n - 1, 7] - cyc[p, 0, 0]) / float(cyc[p, n - 1, 10] - cyc[p, 0, 9])
                      for p, n in enumerate(per_program)) / programs
            parts = summarize(cyc, per_program, ghz)
            print(f"\nW {N}×{K}, T = {T}: {ms * 1e3:.1f} µs (the product kernel: {ms_product * 1e3:.1f}), "
                  f"{programs} programs × up to {max(per_program)} tiles, SM clock {ghz:.2f} GHz, "
                  f"same bits as fused_linear_step: {same}")
            for k, v in parts.items():
                print(f"  {k:>26}: {v:7.2f} µs")


if __name__ == "__main__":
    main()
