"""Redraw a forge-bench PNG and print its table from the JSON alone (no GPU): python bench/replot.py FILE.json ...

The PNG is written next to the JSON, with the same name.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from forge_dsl.bench import convergence, kernel, model
from forge_dsl.bench.common import Results


def replot(path: Path) -> str:
    results = object.__new__(Results)
    results.data = json.loads(path.read_text())
    results.json_path, results.png_path = path, path.with_suffix(".png")
    module = {"kernel": kernel, "model": model, "convergence": convergence}[results.data["subcommand"]]
    results.plot(module.plot)
    if module is convergence:
        return convergence.table(results.rows, results.data["settings"]["window"])
    return module.table(results.rows)


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print(f"{name}: {replot(Path(name))}\n")
