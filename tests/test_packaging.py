"""A non-editable install carries the grammar, the specs, the templates and the generated kernels."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def test_wheel_ships_grammar_specs_templates_and_generated(tmp_path):
    if shutil.which("pip") is None and subprocess.run([sys.executable, "-m", "pip", "--version"]).returncode:
        pytest.skip("pip is not available")
    build = tmp_path / "src"
    shutil.copytree(ROOT, build, ignore=shutil.ignore_patterns(".git", "*.egg-info", "build", ".ci-venv",
                                                               "__pycache__", ".hypothesis", ".pytest_cache"))
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(build)],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    (wheel,) = tmp_path.glob("forge_dsl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "forge_dsl/grammars/fopt.lark" in names
    assert "forge_dsl/templates/module.py.j2" in names
    for spec in (ROOT / "optimizers").glob("*.fopt"):
        assert f"forge_dsl/optimizers/{spec.name}" in names
        assert f"forge_dsl/generated/{spec.stem}.py" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "forge-gen = forge_dsl.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
