"""`forge-test`: property-test specs' generated kernels against their float64 reference step.

    forge-test adamw --quick                          # a built-in spec, the one-minute version
    forge-test my_opt.fopt                            # a user spec, the full sweep (several minutes)
    forge-test adamw --against torch.optim:AdamW      # also the reference step against a torch.optim class
    forge-test adamw --against torch.optim:AdamW --reference-only
    forge-test muon --quick                           # a spec in phases: each phase (muon#tile, muon#post)

Prints one line per case (spec, path, check, flags on, layout, weights, shape, worst error, bound,
verdict) and, for the first failure, what failed and Python lines that rerun it. Exit status: 0 when
every case passes, 1 on any failure (or a spec error), 2 for a usage error.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from ..interpreter import use_interpreter

__all__ = ["main", "build_parser"]


class UsageError(Exception):
    """A bad command line: printed, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="forge-test", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("specs", nargs="+", metavar="SPEC", help="a built-in name (adamw, lion, ...) or a .fopt path")
    ap.add_argument("--against", metavar="MODULE:CLASS",
                    help="also check the reference step against this torch.optim-style class (e.g. torch.optim:AdamW)")
    ap.add_argument("--reference-only", action="store_true", help="with --against: only that check, no kernels")
    ap.add_argument("--quick", action="store_true", help="about a minute per spec in the Triton interpreter")
    ap.add_argument("--steps", type=int, metavar="N", help="steps per case (default 8, 4 with --quick)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None,
                    help="cpu: the Triton interpreter; cuda: compiled kernels (default: cuda when available)")
    ap.add_argument("--seed", type=int, default=0, metavar="S", help="seed of every draw (default 0)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each case's result as it comes")
    return ap



def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        return _main(args)
    except UsageError as err:
        print(f"forge-test: {err}", file=sys.stderr)
        return 2


def _main(args) -> int:
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device here (use --device cpu)")
    if args.device == "cpu" and not args.reference_only:
        try:
            use_interpreter("forge-test ... --device cpu")
        except RuntimeError as err:
            raise UsageError(str(err)) from None
    if args.steps is not None and args.steps < 1:
        raise UsageError(f"--steps must be a positive integer, got {args.steps}")
    if args.reference_only and args.against is None:
        raise UsageError("--reference-only checks the reference against a class: give --against MODULE:CLASS")

    from ..api import load_spec
    from ..spec.errors import SpecError
    from .cases import load_against
    from .sweep import Report, _run, check_reference, plan_kernel_cases

    if args.against is not None:
        try:
            load_against(args.against)
        except ValueError as err:
            raise UsageError(str(err)) from None
    specs = []
    for name in args.specs:
        try:
            specs.append(load_spec(name))
        except FileNotFoundError as err:
            raise UsageError(str(err)) from None
        except SpecError as err:
            print(err, file=sys.stderr)
            return 1
    from ..spec.phases import is_phased, plan
    if args.against is not None and any(is_phased(s) for s in specs):
        raise UsageError("--against compares a spec's reference with a torch optimizer on drawn keywords; for a spec "
                         "in phases (forge-gen --explain) tests/compiler/test_parity_torch.py does (muon, lamb)")
    # a spec in phases: the kernels of each phase against that phase's reference ("muon#tile", "muon#post")
    names = [ref for name, s in zip(args.specs, specs)
             for ref in ([f"{name}#{p.name.rsplit('_', 1)[1]}" for p in plan(s).phases] if is_phased(s) else [name])]
    progress = _progress if args.verbose else None
    threads = torch.get_num_threads()
    if args.device == "cpu":
        # The interpreter's tiny tensor ops: one thread keeps them from stalling in OpenMP spin-waits on a
        # busy machine (as forge-bench does on the CPU).
        torch.set_num_threads(1)
    report = Report()
    try:
        for name in names:
            if not args.reference_only:
                report.extend(_run(plan_kernel_cases(name, quick=args.quick, steps=args.steps, device=args.device,
                                                     seed=args.seed), progress))
            if args.against is not None:
                report.extend(check_reference(name, args.against, steps=args.steps, seed=args.seed,
                                              progress=progress))
    finally:
        torch.set_num_threads(threads)
    print(report.table())
    failed = len(report.failures)
    print(f"\n{len(report.rows)} cases, {len(report.rows) - failed} passed, {failed} failed "
          f"in {report.seconds:.1f} s ({args.device})")
    if report.first_failure is not None:
        print()
        print(report.reproducer)
        return 1
    return 0


def _progress(result) -> None:
    print(result.describe(), file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
