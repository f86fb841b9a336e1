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
        RuntimeError: triton is already imported without it (the message says how to run `command`).
    """
    if interpreting():
        return
    if "triton" in sys.modules:
        raise RuntimeError(f"--device cpu needs TRITON_INTERPRET=1 before triton is imported; "
                           f"run it as: TRITON_INTERPRET=1 {command} ... --device cpu")
    os.environ["TRITON_INTERPRET"] = "1"
