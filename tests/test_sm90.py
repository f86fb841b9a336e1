"""Every built-in spec's fused kernel compiles for the H100/H200 (sm_90) — on this CPU machine.

The Triton interpreter runs code that the GPU compiler rejects (a non-constexpr global, an
unsupported cast), so the interpreter tiers alone would let such a template change through to
the GPU. `forge_dsl.kernels.sm90` compiles ahead of time with Triton's bundled ptxas; the
register report guards the tile configs against spills (docs/PERF.md, v2: a spilling epilogue
was what made 128×128 tiles slow at small token counts).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import triton

import forge_dsl

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(BIN, "cuobjdump")),
                                reason="this Triton has no bundled NVIDIA tools")

# (spec, state layout, hypers, config): None is the default config at 2048 tokens for a 4096² layer
# (halves, TMA); the others are the 512-token default and the plain-load token loop of small layers.
CASES = [(name, layout, {"momentum": 0.9} if name == "sgd_momentum" else {}, None)
         for name in forge_dsl.builtin_names() for layout in ("bf16", "int8")]
CASES += [("rmsprop", "bf16", h, None)
          for h in ({"momentum": 0.9}, {"centered": True}, {"centered": True, "momentum": 0.9})]
CASES += [("adamw", "bf16", {}, "64,64,64,4,4,1,1"), ("adamw", "bf16", {}, "64,64,64,4,4"),
          ("adamw", "int8", {}, "128,64,64,4,3")]

# The compiler needs real @triton.jit functions: compile in a process without the interpreter.
SCRIPT = """
import json, sys
from dataclasses import asdict
from forge_dsl.kernels.launch import TileConfig
from forge_dsl.kernels.sm90 import compile_fused
cases = json.loads(sys.argv[1])
print(json.dumps([asdict(compile_fused(name, layout, TileConfig.parse(config) if config else None, T=2048, **hypers))
                  for name, layout, hypers, config in cases]))
"""


@pytest.fixture(scope="module")
def resources():
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(CASES)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(zip(range(len(CASES)), json.loads(out.stdout.strip().splitlines()[-1])))


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{n}-{l}-{h}-{c}" for n, l, h, c in CASES])
def test_fused_kernel_compiles_for_sm90_without_spills(resources, index):
    """The configs up to 4096 tokens: no spills, a pipelined token loop (asynchronous copies: TMA, or
    cp.async for plain loads), 16-byte W and state access."""
    res = resources[index]
    assert res["stack_bytes"] == 0, f"{CASES[index]} spills: {res}"
    assert res["registers"] <= 255
    ops = res["memory_ops"]
    tma = CASES[index][3] is None or CASES[index][3].endswith(",1")
    assert ops.get("cp.async.bulk.tensor." if tma else "cp.async.cg.shared.global", 0) > 0, res
    assert ops.get("ld.global.v4.b32", 0) > 0 and ops.get("st.global.v4.b32", 0) > 0, res
