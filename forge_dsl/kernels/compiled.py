"""Finding the generated module of a spec, compiling it on first use when needed.

Built-in specs use the committed module in generated/ (forge_dsl.generated.<name>)
when its header hashes match the spec and the templates.  Any other spec, or a
built-in whose generated module is stale, is rendered into a cache folder
(`$FORGE_DSL_CACHE`, default `~/.cache/forge_dsl`) and imported from there;
the file name carries both hashes, so a changed spec or template compiles anew.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from types import ModuleType

from .. import ir
from ..codegen import render_module, spec_hash, template_hash

__all__ = ["compiled_module", "cache_dir"]


def cache_dir() -> Path:
    return Path(os.environ.get("FORGE_DSL_CACHE", Path.home() / ".cache" / "forge_dsl"))


# id(spec) -> (spec, module): the launchers ask once per layer per step, so the lookup must be
# cheaper than hashing the spec's text or its IR.
_BY_SPEC_OBJECT: dict[int, tuple[ir.Spec, ModuleType]] = {}


def compiled_module(spec: ir.Spec) -> ModuleType:
    """The generated module for `spec` (see the module docstring)."""
    hit = _BY_SPEC_OBJECT.get(id(spec))
    if hit is not None and hit[0] is spec:
        return hit[1]
    module = _compiled(spec.name, spec_hash(spec.source), template_hash(), spec)
    _BY_SPEC_OBJECT[id(spec)] = (spec, module)
    return module


@functools.lru_cache(maxsize=64)
def _compiled(name: str, s_hash: str, t_hash: str, spec: ir.Spec) -> ModuleType:
    try:
        module = importlib.import_module(f"forge_dsl.generated.{name}")
    except ImportError:
        module = None
    if module is not None and getattr(module, "SPEC_HASH", None) == s_hash and getattr(module, "TEMPLATE_HASH", None) == t_hash:
        return module

    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}_{s_hash}_{t_hash}.py"
    if not path.is_file():
        text = render_module(spec, spec.path)
        # Atomic: concurrent first uses never import a half-written file.
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    module_name = f"forge_dsl_compiled_{name}_{s_hash}_{t_hash}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module  # Triton reads the kernels' source through their module
    module_spec.loader.exec_module(module)
    return module
