"""Redraw a forge-bench PNG and print its table from the JSON alone (no GPU).

    python -m forge_dsl.bench.replot FILE.json ...

The PNG is written next to the JSON, with the same name.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional, Sequence

from . import convergence, kernel, model
from .common import Results


SUBCOMMANDS = {"kernel": kernel, "model": model, "convergence": convergence}


def table(data: dict) -> str:
    """The Markdown table of a forge-bench record (its JSON, loaded), as its subcommand printed it."""
    if data["subcommand"] == "convergence":
        return convergence.table(data["rows"], data["settings"]["window"])
    return SUBCOMMANDS[data["subcommand"]].table(data["rows"])


def replot(path: Path) -> str:
    """Draw the PNG beside the record at `path` (same name) from its JSON; its table."""
    results = object.__new__(Results)
    results.data = json.loads(path.read_text())
    results.json_path, results.png_path = path, path.with_suffix(".png")
    results.plot(SUBCOMMANDS[results.data["subcommand"]].plot)
    return table(results.data)


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m forge_dsl.bench.replot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", metavar="FILE.json", help="a forge-bench record (JSON)")
    for name in ap.parse_args(argv).files:
        print(f"{name}: {replot(Path(name))}\n")


if __name__ == "__main__":
    main()
