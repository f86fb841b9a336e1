"""Compile a spec's fused kernel for the H100/H200 (sm_90) on any machine, no GPU needed.

The Triton interpreter accepts code that the GPU compiler rejects, and it says nothing about
registers. This compiles the real thing ahead of time with Triton's bundled ptxas and reports
what decides the speed of a fused kernel: registers per thread (≤ 255; beyond, the compiler
spills to local memory, `stack_bytes` > 0), shared memory per program, and how the global
memory is accessed (16-byte vector loads; the token loop's asynchronous copies: TMA
`cp.async.bulk.tensor`, or `cp.async` for plain loads).

    python -m forge_dsl.bench.sm90 adamw --layout bf16 --config 64,64,64,4,4
    python -m forge_dsl.bench.sm90 adamw --layout int4 --cols 4100   (int4 state's byte path: K % 8 != 0)
    python -m forge_dsl.bench.sm90 --all          (every spec, default configs)

The numbers are those of the installed Triton, which may differ from the GPU machine's.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import torch

from ..api import SpecLike, builtin_names, init_state, load_spec
from ..kernels import gluon_lib, tile_kernels
from ..kernels.checks import any_quantized
from ..kernels.kernel_calls import fused_constexprs, nibble_words, rounding_code, ws_constexprs
from ..kernels.layouts import StateLayout, is_quantized, n_blocks
from ..kernels.policy import TileConfig, fused_config, stored_bytes
from ..kernels.steps import ParamUpdate

__all__ = ["Resources", "compile_fused", "main"]

_STATE_POINTER = {StateLayout.FP32: "*fp32", StateLayout.BF16: "*i16", StateLayout.INT8: "*i8",
                  StateLayout.UINT8_SQRT: "*u8", StateLayout.INT4: "*i8", StateLayout.UINT4: "*u8"}
# The block scales as `checks.bind_states` passes them: float32, or bfloat16 as its int16 view.
_SCALE_POINTER = {torch.float32: "*fp32", torch.int16: "*i16"}
# Arguments the JIT would see as multiples of 16 for the usual layer sizes (pointers and sizes); K, x's row stride
# and n_blocks too where the layer's columns make them so (`compile_fused`).
_DIVISIBLE = {"X", "DY", "W", "N", "stride_dyt"}


@dataclass(frozen=True)
class Resources:
    """What ptxas reports for one compiled kernel."""

    registers: int
    stack_bytes: int  # > 0: registers spilled to local memory
    shared_bytes: int
    memory_ops: dict  # PTX global/async memory instructions by kind, e.g. {"ld.global.v4.b32": 12}

    def __str__(self) -> str:
        ops = ", ".join(f"{k} ×{v}" for k, v in sorted(self.memory_ops.items()))
        return (f"{self.registers} registers, {self.stack_bytes} B stack (spills), "
                f"{self.shared_bytes // 1024} KiB shared | {ops}")


def compile_fused(spec: SpecLike, layout: str = "bf16", config: Optional[TileConfig] = None, T: int = 2048,
                  activations: str = "bf16", cols: int = 4096, **hypers) -> Resources:
    """Compile the fused kernel of `spec` (bf16 weights, stochastic rounding) for sm_90, for a [4096, cols] layer.

    `hypers` pick the variant (flags) as `fused_linear_step` would; `config` defaults to
    `fused_config` for T tokens on a CUDA device. `activations`: "bf16", or "fp32" / "tf32" for
    float32 activations with exact or TF32 products. `cols` decides what a launch would of the columns: the
    rounding code, whether 4-bit state is accessed in words (`kernel_calls.nibble_words`), whether the
    activations' rows allow TMA (a multiple of 16 bytes: never for a bf16 K % 8 != 0, so neither the
    warp-specialized kernel) and which sizes are multiples of 16.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    spec = load_spec(spec)
    weight = torch.zeros(128, 128, dtype=torch.bfloat16)
    state = init_state(spec, weight, layout=layout, **hypers)
    bound = ParamUpdate(spec, weight, state, step=1, **hypers)
    update, exports, states = bound.update, bound.exports, bound.states
    fp32 = activations in ("fp32", "tf32")
    tma_rows = cols * (4 if fp32 else 2) % 16 == 0  # `checks.tma_compatible` of x [T, cols]
    cfg = config or fused_config(T, 4096, cols, torch.device("cuda"), any_quantized(states.layouts),
                                 torch.float32 if fp32 else torch.bfloat16, warp_specialize=tma_rows,
                                 hopper=gluon_lib.AVAILABLE, stored_bytes=stored_bytes(True, states.layouts))
    if cfg.warp_specialized and not tma_rows:
        raise ValueError(f"the warp-specialized kernel reads the activations through TMA, whose rows must be a "
                         f"multiple of 16 bytes; {cols} columns are not: give a config without mma_warps")
    tma = cfg.tma and tma_rows  # as `kernel_calls.launch_fused` falls back to plain loads
    act = "fp32" if fp32 else "bf16"
    precision = {"fp32": "ieee", "tf32": "tf32"}.get(activations)
    stochastic = rounding_code("stochastic", cols)  # even cols: one hash per two elements
    words = nibble_words(cols, states)
    if cfg.warp_specialized:
        if fp32 or gluon_lib.fused_ws is None:
            raise ValueError("the warp-specialized kernel needs bf16 activations and Triton ≥ 3.6 with Gluon")
        fused = gluon_lib.fused_ws
        constexprs = ws_constexprs(cfg, update, True, stochastic, states.layouts, words, 132)
    else:
        fused = tile_kernels.fused
        constexprs = {**fused_constexprs(cfg, update, True, stochastic, states.layouts, words, fp32, precision, tma),
                      "stride_xk": 1, "stride_dyn": 1}
    storage = tuple(_STATE_POINTER[StateLayout(code)] for code in states.layouts)
    signature = {}
    for arg in fused.arg_names:
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg in ("X", "DY") and cfg.warp_specialized:
            block = cfg.tma_blocks[0 if arg == "X" else 1]
            signature[arg] = f"tensordesc<bf16{block},{gluon_lib.shared_layout(tuple(block))!r}>"
        elif arg in ("X", "DY") and tma:
            signature[arg] = f"tensordesc<{act}{cfg.tma_blocks[0 if arg == 'X' else 1]}>"
        elif arg in ("X", "DY"):
            signature[arg] = f"*{act}"
        elif arg in ("W", "TL"):  # TL: the timeline buffer, never read without one (the weight's pointer)
            signature[arg] = "*i16"
        elif arg == "STATES":
            signature[arg] = storage
        elif arg == "SCALES":  # the block scales of int8 / uint8 state, the storage itself (never read) otherwise
            signature[arg] = tuple(_SCALE_POINTER[scale.dtype] if is_quantized(code) else pointer
                                   for code, pointer, scale in zip(states.layouts, storage, states.scales))
        elif arg == "HOST":
            signature[arg] = tuple("i32" if isinstance(value, int) else "fp32" for value in exports)
        else:
            signature[arg] = "i32"
    divisible = _DIVISIBLE | ({"K", "stride_xt"} if cols % 16 == 0 else set()) | (
        {"n_blocks"} if n_blocks(cols) % 16 == 0 else set())
    attrs = {}
    for i, arg in enumerate(fused.arg_names):
        if arg in divisible:
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif arg in ("STATES", "SCALES"):
            attrs.update({(i, j): [["tt.divisibility", 16]] for j in range(len(states.layouts))})
    if cfg.warp_specialized:
        from triton.experimental.gluon._runtime import GluonASTSource

        source = GluonASTSource(fused, signature, constexprs, attrs=attrs)
    else:
        source = ASTSource(fused, signature, constexprs, attrs=attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
                                     "maxnreg": cfg.launch_maxnreg})
    return _resources(kernel, triton)


def _resources(kernel, triton) -> Resources:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    found = dict(re.findall(r"(REG|STACK):(\d+)", usage))
    ops = Counter(re.findall(r"^\s*(?:@!?%p\d+\s+)?((?:ld|st)\.(?:global|local)[a-z0-9.]*|cp\.async\.[a-z.]*)",
                             kernel.asm["ptx"], re.M))
    return Resources(int(found["REG"]), int(found["STACK"]), int(kernel.metadata.shared), dict(ops))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m forge_dsl.bench.sm90", description=__doc__.splitlines()[0])
    ap.add_argument("spec", nargs="?", default="adamw", help="built-in name or .fopt path (default adamw)")
    ap.add_argument("--all", action="store_true", help="every built-in spec")
    ap.add_argument("--layout", default="bf16", help="state layout: fp32, bf16, int8 or int4 (default bf16)")
    ap.add_argument("--config", help="BT,BN,BK,WARPS,STAGES[,HALVES[,TMA]][,split=S][,maxnreg=R] "
                                     "(default: fused_config for --tokens)")
    ap.add_argument("--tokens", type=int, default=2048, help="T for the default config (default 2048)")
    ap.add_argument("--activations", choices=("bf16", "fp32", "tf32"), default="bf16",
                    help="bf16, or float32 with exact (fp32) or TF32 products (default bf16)")
    ap.add_argument("--cols", type=int, default=4096,
                    help="the layer's K (default 4096); one not a multiple of 8 compiles int4 state's byte path")
    args = ap.parse_args(argv)
    config = TileConfig.parse(args.config) if args.config else None
    for name in builtin_names() if args.all else [args.spec]:
        hypers = {"momentum": 0.9} if load_spec(name).name == "sgd_momentum" else {}
        resources = compile_fused(name, args.layout, config, args.tokens, args.activations, args.cols, **hypers)
        print(f"{name:>13} {args.layout:>5}: {resources}")


if __name__ == "__main__":
    main()
