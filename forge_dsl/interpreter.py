"""Choosing Triton's interpreter from a command line, before triton is first imported.

`TRITON_INTERPRET=1` takes effect only if it is set before `import triton`; the console scripts
(`forge-bench`, `forge-test`) call `use_interpreter` for `--device cpu` before they import anything
that imports triton. Nothing here imports triton.
"""

from __future__ import annotations

import os
import sys

__all__ = ["use_interpreter"]


def use_interpreter(command: str) -> None:
    """Set TRITON_INTERPRET=1 for this process.

    Raises:
        RuntimeError: triton is already imported without it (the message says how to run `command`).
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    if "triton" in sys.modules:
        raise RuntimeError(f"--device cpu needs TRITON_INTERPRET=1 before triton is imported; "
                           f"run it as: TRITON_INTERPRET=1 {command} ... --device cpu")
    os.environ["TRITON_INTERPRET"] = "1"
