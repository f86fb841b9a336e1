"""`forge-gen`: compile `.fopt` specs into Triton modules.

    forge-gen optimizers/             # writes generated/<name>.py for every spec; rewrites only what changed
    forge-gen --check optimizers/     # exit 1, with the command that fixes it, when generated/ is stale
    forge-gen my_opt.fopt -o out/     # a single spec anywhere

Without `-o`, the output folder is `generated/` beside a folder named
`optimizers/`, and otherwise the spec's own folder.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .api import load_spec
from .codegen import render_module
from .errors import SpecError

__all__ = ["main", "generate"]


def _spec_files(paths: list[str]) -> list[Path]:
    files: list[Path] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            files.extend(sorted(path.glob("*.fopt")))
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"no such spec file or folder: {p}")
    return files


def _default_out(spec_file: Path) -> Path:
    folder = spec_file.resolve().parent
    return folder.parent / "generated" if folder.name == "optimizers" else folder


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def generate(spec_file: Path, out_dir: Path) -> tuple[Path, str]:
    """(target path, generated text) for one spec file; raises SpecError on a bad spec."""
    spec = load_spec(str(spec_file))
    if spec.name != spec_file.stem:
        raise SpecError(
            f"optimizer '{spec.name}' is in a file named '{spec_file.name}'; name the file '{spec.name}.fopt'",
            spec.loc,
            spec.source,
        )
    # The header names the spec by its path relative to its folder's parent, so output
    # does not depend on where the command runs.
    shown = f"{spec_file.resolve().parent.name}/{spec_file.name}"
    return out_dir / f"{spec.name}.py", render_module(spec, shown)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="forge-gen", description="Compile .fopt optimizer specs into Triton modules.")
    parser.add_argument("paths", nargs="+", help=".fopt files or folders of them")
    parser.add_argument("-o", "--out", help="output folder (default: generated/ beside optimizers/)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if any output is stale")
    args = parser.parse_args(argv)

    try:
        files = _spec_files(args.paths)
    except FileNotFoundError as err:
        print(f"forge-gen: {err}", file=sys.stderr)
        return 2
    if not files:
        print(f"forge-gen: no .fopt files in {' '.join(args.paths)}", file=sys.stderr)
        return 2

    stale: list[str] = []
    failed = False
    for spec_file in files:
        out_dir = Path(args.out) if args.out else _default_out(spec_file)
        try:
            target, text = generate(spec_file, out_dir)
        except SpecError as err:
            print(err, file=sys.stderr)
            failed = True
            continue
        current = target.read_text() if target.is_file() else None
        if current == text:
            if not args.check:
                print(f"unchanged {_display(target)}")
            continue
        if args.check:
            stale.append(_display(target))
            continue
        out_dir.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        print(f"wrote     {_display(target)}")
    if failed:
        return 1
    if stale:
        command = "forge-gen " + " ".join(args.paths) + (f" -o {args.out}" if args.out else "")
        print(f"forge-gen: stale or missing: {', '.join(stale)}; run `{command}` and commit the result",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
