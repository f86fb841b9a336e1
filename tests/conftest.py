"""Test setup: run Triton kernels in the interpreter when there is no CUDA device; the shared helpers import.

The tests sit in the package's rooms (tests/spec, compiler, kernels, training, tools, architecture);
tests/helpers holds the modules they share (`training_models`, `references`, `fuzz_kernels`, `tp_checks`,
`repo`, `tiers`: a sweep's quick cases and slow ones), importable by name from any test. `pytest` runs the quick
tier, `pytest -m slow` the rest (pyproject.toml).
"""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover - torch is a hard dependency
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
