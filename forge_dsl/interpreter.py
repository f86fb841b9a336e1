"""Whether the kernels run in Triton's interpreter, and choosing it before triton is first imported.

`TRITON_INTERPRET=1` takes effect only if it is set before `import triton`; the console scripts
(`forge-bench`, `forge-test`) and the demo call `use_interpreter` on a machine without CUDA before they
import anything that imports triton (`import forge_dsl` does not). Nothing here imports torch or triton.
"""

from __future__ import annotations

import os
import sys

__all__ = ["interpreting", "use_interpreter"]


def interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels (`TRITON_INTERPRET=1`): tensors then live on the CPU."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_interpreter(command: str) -> None:
    """Set TRITON_INTERPRET=1 for this process.

    Raises:
        RuntimeError: triton is already imported without it; the message says to run `command` (the whole
            command line, e.g. "forge-test --device cpu") with TRITON_INTERPRET=1 set.
    """
    if interpreting():
        return
    if "triton" in sys.modules:
        raise RuntimeError(f"Triton's interpreter (TRITON_INTERPRET=1) must be chosen before triton is imported, "
                           f"and something imported triton already; run it as: TRITON_INTERPRET=1 {command}")
    os.environ["TRITON_INTERPRET"] = "1"
