"""Packaging: the wheel carries the grammar, specs, templates and generated kernels; the sdist carries what
the tests read; the license and classifiers are declared; the dependency floors are what CI tests."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from repo import ROOT

import forge_dsl
from forge_dsl.spec.phases import is_phased, plan

tomllib = pytest.importorskip("tomllib", reason="reads pyproject.toml with tomllib (Python 3.11+)")



PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _copy_source(dest: Path) -> None:
    """The source tree without git, venvs and caches (what an sdist or wheel build starts from)."""
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(".git", "*.egg-info", "build", "dist", ".ci-venv*",
                                                              "__pycache__", ".hypothesis", ".pytest_cache",
                                                              "base", "scratch"))


def test_wheel_ships_grammar_specs_templates_and_generated(tmp_path):
    build = tmp_path / "src"
    _copy_source(build)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(build)],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    (wheel,) = tmp_path.glob("forge_dsl-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "forge_dsl/grammars/fopt.lark" in names
    assert "forge_dsl/compiler/templates/module.py.j2" in names
    for spec in (ROOT / "optimizers").glob("*.fopt"):
        assert f"forge_dsl/optimizers/{spec.name}" in names
        loaded = forge_dsl.load_spec(spec.stem)
        for module in plan(loaded).phases if is_phased(loaded) else (loaded,):  # a module per phase
            assert f"forge_dsl/generated/{module.name}.py" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "forge-gen = forge_dsl.compiler.forge_gen:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: MIT" in metadata and "Classifier: Programming Language :: Python :: 3" in metadata
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)


def test_sdist_carries_what_the_tests_read(tmp_path):
    """Every file the tests open (tests/, the specs, grammar, generated kernels, docs, bench/, README, the CI
    script) is in the sdist, beside the package and the license."""
    build = tmp_path / "src"
    _copy_source(build)
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from setuptools import build_meta; build_meta.build_sdist(sys.argv[1])",
         str(tmp_path)], cwd=build, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    (sdist,) = tmp_path.glob("forge_dsl-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    wanted = {"LICENSE", "README.md", "pyproject.toml", ".ci/run", "forge_dsl/__init__.py"}
    for folder in ("tests", "optimizers", "grammars", "generated", "docs", "bench", "forge_dsl"):
        wanted |= {str(p.relative_to(build)) for p in (build / folder).rglob("*")
                   if p.is_file() and p.suffix not in (".pyc", ".tmp")}
    assert wanted - names == set()


def test_license_file_and_classifiers():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "Copyright (c)" in text and "FORGE-DSL contributors" in text
    project = PYPROJECT["project"]
    assert project["license"] == "MIT" and project["license-files"] == ["LICENSE"]
    classifiers = project["classifiers"]
    assert "Operating System :: POSIX :: Linux" in classifiers
    assert not any(c.startswith("License ::") for c in classifiers)  # the SPDX `license` says it
    # the Python running the tests has its classifier, and the lowest one is requires-python's floor
    versions = {c.rsplit(" ", 1)[1] for c in classifiers
                if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)}
    assert f"{sys.version_info.major}.{sys.version_info.minor}" in versions
    assert project["requires-python"] == f">={min(versions, key=lambda v: tuple(map(int, v.split('.'))))}"
    try:
        from trove_classifiers import classifiers as known
    except ImportError:
        return
    assert set(classifiers) <= known


def _ci_pins(name: str) -> dict[str, str]:
    """`NAME="pkg==version ..."` of .ci/run, as {pkg: version}."""
    match = re.search(rf'^{name}="([^"]*)"$', (ROOT / ".ci" / "run").read_text(), re.M)
    assert match, f".ci/run has no {name}=... line"
    return dict(pin.split("==") for pin in shlex.split(match.group(1)))


def _floors(requirements: list[str]) -> dict[str, str]:
    floors = {}
    for req in requirements:
        name, _, rest = re.match(r"([A-Za-z0-9_.-]+)(\[[^]]*\])?\s*(.*)", req).groups()
        match = re.search(r">=\s*([0-9][0-9.]*)", rest)
        assert match, f"{req!r} has no floor (>=)"
        floors[name.lower()] = match.group(1)
    return floors


def test_dependency_floors_are_what_ci_installs_for_the_oldest_leg():
    """Each runtime dependency has a floor, and .ci/run's oldest leg pins exactly those versions (so what
    pyproject claims is what CI tests); the current leg tests versions at or above them."""
    floors = _floors(PYPROJECT["project"]["dependencies"])
    oldest = _ci_pins("OLDEST")
    assert set(oldest) == set(floors)
    for name, floor in floors.items():
        # `>=X.Y` is tested at X.Y.0 (or the exact release named)
        pinned = oldest[name].split(".")
        parts = floor.split(".")
        assert pinned[:len(parts)] == parts and all(p == "0" for p in pinned[len(parts):]), (name, floor, oldest[name])
    current = _ci_pins("CURRENT")
    assert set(current) == {"torch", "triton"}
    for name, version in current.items():
        assert tuple(map(int, version.split("."))) >= tuple(map(int, floors[name].split(".")))


def test_gpu_machines_torch_and_triton_are_allowed():
    """The H200 runs torch 2.11 with Triton 3.6: the floors must admit them."""
    floors = _floors(PYPROJECT["project"]["dependencies"])
    assert tuple(map(int, floors["torch"].split("."))) <= (2, 11)
    assert tuple(map(int, floors["triton"].split("."))) <= (3, 6)


def test_numpy_is_declared_where_it_is_used():
    """numpy: a runtime dependency only because Triton's interpreter imports it (the package itself does not);
    the tests import it, so the test extra names it too."""
    package_sources = [p for p in (ROOT / "forge_dsl").rglob("*.py")]
    assert not any(re.search(r"^\s*(import numpy|from numpy)", p.read_text(), re.M) for p in package_sources)
    triton_interpreter = Path(__import__("triton").__file__).parent / "runtime" / "interpreter.py"
    assert re.search(r"^import numpy", triton_interpreter.read_text(), re.M)
    assert "numpy" in _floors(PYPROJECT["project"]["dependencies"])
    assert any(r.startswith("numpy") for r in PYPROJECT["project"]["optional-dependencies"]["test"])
