"""What a spec costs on its first use, per built-in spec: the generated module's size, rendering it,
loading it, and the first and second `fused_linear_step` call (the first compiles the variant's kernel
on a GPU; in the interpreter it traces it).

    python -m forge_dsl.bench.first_call [--specs adamw,lion] [--device cpu|cuda]

Run it in a fresh process with a fresh Triton cache (TRITON_CACHE_DIR) for compile times. Prints a
Markdown table.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m forge_dsl.bench.first_call", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--specs", default="adagrad,adamw,lion,nadam,radam,rmsprop,sgd,sgd_momentum")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None)
    args = ap.parse_args()
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="triton-first-call-"))
    os.environ.setdefault("FORGE_DSL_CACHE", tempfile.mkdtemp(prefix="forge-first-call-"))
    import forge_dsl
    from forge_dsl.compiler import codegen
    from forge_dsl import kernels
    from forge_dsl.compiler import loader as compiled

    n, k, t = (1024, 1024, 512) if device.type == "cuda" else (72, 136, 40)
    rows = []
    for name in args.specs.split(","):
        spec = forge_dsl.load_spec(name)
        start = time.perf_counter()
        # render_module(spec, output) since 2026-12; before, render_module(spec, spec_path): the base tree
        output = "cache" if "output" in inspect.signature(codegen.render_module).parameters else spec.path
        text = codegen.render_module(spec, output)
        render_s = time.perf_counter() - start
        start = time.perf_counter()
        compiled.compiled_module(spec)
        load_s = time.perf_counter() - start
        hypers = {"lr": 1e-3, **({"momentum": 0.9} if name == "sgd_momentum" else {})}
        w = torch.randn(n, k, device=device).to(torch.bfloat16 if device.type == "cuda" else torch.float32)
        act = w.dtype
        x = torch.randn(t, k, device=device).to(act)
        dy = torch.randn(t, n, device=device).to(act)
        state = forge_dsl.init_state(spec, w, layout="bf16", **hypers)
        times = []
        for step in (1, 2):
            start = time.perf_counter()
            kernels.fused_linear_step(spec, x, dy, w, state, step=step, **hypers)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        rows.append((name, text.count("\n"), len(text.encode()), render_s, load_s, *times))
    print(f"device {device}, {sys.version.split()[0]}, forge_dsl at {os.path.dirname(forge_dsl.__file__)}")
    print("| spec | lines | bytes | render s | load s | first call s | second call s |")
    print("|---|---|---|---|---|---|---|")
    for name, lines, size, render_s, load_s, first, second in rows:
        print(f"| {name} | {lines} | {size} | {render_s:.3f} | {load_s:.3f} | {first:.3f} | {second:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
