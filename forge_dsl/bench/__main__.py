"""`forge-bench`: the FORGE benchmark suite.

    forge-bench kernel [--quick] [--specs adamw,lion] [--shapes llama3.1-8b] [--tokens 2048] [--layouts bf16]
    forge-bench model [--quick] [--models llama3.1-8b] [--methods torch-adamw,forge-bf16]
    forge-bench convergence [--quick] [--steps 2000]

Each subcommand shows its progress on stderr (a bar on a terminal, plain lines in a log),
writes `<out>/<subcommand>[-quick]-<date>.json` and `.png` (default out: bench/results;
the PNG only where matplotlib is installed), and prints a Markdown table last.
`--device cpu` runs the kernels in the Triton interpreter (tiny shapes; timings by
time.perf_counter, memory not measured, no roofline): that is what the tests run.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

import torch

from ..interpreter import use_interpreter
from .common import UsageError

__all__ = ["main"]

HELP = {
    "kernel": "one linear layer's update: fused kernel vs cuBLAS dW + a step kernel, against the roofline",
    "model": "whole-model training step on Llama-3.1-8B / Qwen3 shapes: peak memory, step time, breakdown",
    "convergence": "loss curves of a small byte-level Llama on Shakespeare: torch AdamW vs FORGE variants",
}


def subcommands() -> dict:
    """name → module with `add_arguments(parser)` and `run(args, argv, device) -> (Results, table)`."""
    from . import convergence, kernel, model  # imports triton: after the interpreter is chosen

    return {"kernel": kernel, "model": model, "convergence": convergence}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="forge-bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="subcommand", required=True, metavar="{kernel,model,convergence}")
    for name, module in subcommands().items():
        p = sub.add_parser(name, help=HELP[name], description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--quick", action="store_true", help="a smoke version of about a minute")
        p.add_argument("--out", default=os.path.join("bench", "results"), metavar="DIR",
                       help="folder of the JSON and PNG (default: bench/results)")
        p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu",
                       help="cpu: Triton interpreter, tiny shapes (default: cuda when available)")
        module.add_arguments(p)
    return ap



def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available() or _flag_value(argv, "--device") == "cpu":
        try:
            use_interpreter("forge-bench ... --device cpu")  # before build_parser imports the subcommands (and with them triton)
        except RuntimeError as err:
            raise SystemExit(str(err)) from None
    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (use --device cpu)")
    threads = torch.get_num_threads()
    if device.type == "cpu":
        # A smoke run, not a measurement: one thread keeps tiny CPU ops from stalling in OpenMP spin-waits
        # when the machine is busy (two threads on two shared cores ran them ~500x slower).
        torch.set_num_threads(1)
    try:
        results, table = subcommands()[args.subcommand].run(args, argv, device)
    except UsageError as err:  # a bad filter or option
        raise SystemExit(f"forge-bench {args.subcommand}: {err}") from None
    finally:
        torch.set_num_threads(threads)
    if results is None:  # a rank other than 0 of a sharded run (forge-bench model --tp N): rank 0 reports
        return 0
    print(f"wrote {results.json_path}")
    print(f"wrote {results.png_path}\n" if results.png_path else "no PNG (pip install matplotlib)\n")
    print(table)
    return 0


def _flag_value(argv: list[str], flag: str) -> Optional[str]:
    """The value of `--flag VALUE` or `--flag=VALUE` in argv, before argparse runs."""
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


if __name__ == "__main__":
    sys.exit(main())
