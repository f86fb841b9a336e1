"""`forge-gen`: compile `.fopt` specs into Triton modules.

    forge-gen optimizers/             # writes generated/<name>.py for every spec; rewrites only what changed
    forge-gen --check optimizers/     # exit 1, with the command that fixes it, when generated/ is stale or damaged
    forge-gen my_opt.fopt -o out/     # a single spec anywhere
    forge-gen --explain muon.fopt     # print the phases a spec runs as (spec/phases.py); write nothing

A spec that reads the whole weight (`orthogonalize`) or its shape compiles to one module per phase,
`<name>_tile.py` and `<name>_post.py`.

Without `-o`, the output folder is `generated/` beside a folder named `optimizers/`, and otherwise
the spec's own folder (`kernels.compiled.default_out`); with `-o`, forge-gen records the module in
the cache folder's registry.  Either way `load_spec` and the kernels then run this module while it
is current (see forge_dsl/compiler/loader.py).  Files are written atomically.

Exit status: 0 done, 1 a spec error or (with --check) a stale or damaged file, 2 bad arguments or
files that cannot be read or written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..spec.errors import SpecError
from ..spec.loading import load_spec
from ..spec.phases import is_phased, plan
from .codegen import read_stamp, render_module
from .loader import atomic_write, default_out, register

__all__ = ["main", "generate"]


class _InputError(Exception):
    """A problem with forge-gen's arguments or files, printed as one line (exit 2)."""


def _spec_files(paths: list[str]) -> list[Path]:
    files: list[Path] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            try:
                found = sorted(f for f in path.glob("*.fopt") if f.is_file())
            except OSError as err:
                raise _InputError(f"cannot read the folder {p}: {err.strerror or err}") from None
            if not found:
                raise _InputError(f"no .fopt files in {p}")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise _InputError(f"no such spec file or folder: {p}")
    return files


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return str(path)


def _output(spec_file: Path, out_dir: Path) -> str:
    """Which kind of place `out_dir` is for `spec_file` (a key of codegen.OUTPUTS)."""
    if out_dir.resolve() != default_out(spec_file).resolve():
        return "out"
    return "optimizers" if spec_file.resolve().parent.name == "optimizers" else "beside"


def generate(spec_file: Path, out_dir: Path) -> list[tuple[Path, str]]:
    """(target path, generated text) of each module of one spec file: one, or one per phase (`spec.phases`).

    Raises:
        SpecError: a bad spec (or one whose file is not named after it).
        OSError: the spec file cannot be read.
    """
    spec = load_spec(str(spec_file))
    if spec.name != spec_file.stem:
        raise SpecError(
            f"optimizer '{spec.name}' is in a file named '{spec_file.name}'; name the file '{spec.name}.fopt'",
            spec.loc,
            spec.source,
        )
    output = _output(spec_file, out_dir)
    modules = plan(spec).phases if is_phased(spec) else (spec,)
    return [(out_dir / f"{m.name}.py", render_module(m, output)) for m in modules]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="forge-gen", description="Compile .fopt optimizer specs into Triton modules.")
    parser.add_argument("paths", nargs="+", help=".fopt files or folders of them")
    parser.add_argument("-o", "--out",
                        help="output folder (default: generated/ beside optimizers/, else the spec's folder)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if any output is stale or damaged")
    parser.add_argument("--explain", action="store_true",
                        help="write nothing; print each spec's plan: its phases, extra work and transient bytes")
    args = parser.parse_args(argv)

    try:
        files = _spec_files(args.paths)
    except _InputError as err:
        print(f"forge-gen: {err}", file=sys.stderr)
        return 2

    stale: list[str] = []
    damaged: list[str] = []
    spec_failed = io_failed = False
    outputs: list[tuple[Path, Path, Path, str]] = []  # (spec file, out folder, target, text)
    for spec_file in files:
        out_dir = Path(args.out) if args.out else default_out(spec_file)
        try:
            if args.explain:
                print(_explain(load_spec(str(spec_file))))
                continue
            outputs += [(spec_file, out_dir, target, text) for target, text in generate(spec_file, out_dir)]
        except SpecError as err:
            print(err, file=sys.stderr)
            spec_failed = True
        except OSError as err:
            print(f"forge-gen: cannot read {spec_file}: {err.strerror or err}", file=sys.stderr)
            io_failed = True
    for spec_file, out_dir, target, text in outputs:
        data = text.encode()
        try:
            current = target.read_bytes() if target.is_file() else None
        except OSError:
            current = None
        if current != data and args.check:
            stamp = read_stamp(current) if current is not None else None
            (damaged if stamp is not None and not stamp.intact else stale).append(_display(target))
            continue
        if current != data:
            try:
                out_dir.mkdir(parents=True, exist_ok=True)
                atomic_write(target, data)
            except OSError as err:
                print(f"forge-gen: cannot write {target}: {err.strerror or err}", file=sys.stderr)
                io_failed = True
                continue
        if not args.check:
            print(f"{'unchanged' if current == data else 'wrote    '} {_display(target)}")
            if args.out and _output(spec_file, out_dir) == "out":
                try:
                    register(read_stamp(data).spec_hash, target)
                except OSError as err:
                    print(f"forge-gen: warning: {err}; load_spec will not find {_display(target)}", file=sys.stderr)
    if io_failed:
        return 2
    if spec_failed:
        return 1
    if stale or damaged:
        command = "forge-gen " + " ".join(args.paths) + (f" -o {args.out}" if args.out else "")
        parts = ([f"damaged (sha256 does not match the header): {', '.join(damaged)}"] if damaged else []) + (
            [f"stale or missing: {', '.join(stale)}"] if stale else [])
        print(f"forge-gen: {'; '.join(parts)}; run `{command}` and commit the result", file=sys.stderr)
        return 1
    return 0


def _explain(spec) -> str:
    """What `--explain` prints for one spec."""
    if is_phased(spec):
        return plan(spec).describe()
    return (f"{spec.name}: 1 phase, element-wise: fused into each layer's dW tiles in backward (or stepped from "
            ".grad); no transient, no extra GEMM")


if __name__ == "__main__":
    sys.exit(main())
