"""The module paths of forge_dsl 0.1 that moved, kept importing for one more release.

    import forge_dsl.codegen                    # the module forge_dsl.compiler.codegen itself
    from forge_dsl.fused_head import install    # forge_dsl.training.hf_head.install

`ALIASES` is the one table: each old path and the modules that now hold its names, searched in order (an
old module split in several has several); `RENAMED` the few names that changed on the way. Importing an
old path warns once (`DeprecationWarning`, with the new path). An old path moved whole is the new module
itself (`import forge_dsl.codegen` and `forge_dsl.compiler.codegen` are one object); a split one is a
module whose attributes are looked up in its new homes.

`install()` puts the finder that serves them first on `sys.meta_path` (`forge_dsl/__init__.py` calls it);
`attribute(package, name)` answers `forge_dsl.codegen` and `forge_dsl.kernels.launch` written as attributes
of a package that has not imported them.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from typing import Any, Optional

__all__ = ["ALIASES", "RENAMED", "attribute", "install"]

ALIASES: dict[str, tuple[str, ...]] = {
    # the language (forge_dsl.spec)
    "forge_dsl.errors": ("forge_dsl.spec.errors",),
    "forge_dsl.ir": ("forge_dsl.spec.ir",),
    "forge_dsl.parser": ("forge_dsl.spec.parser",),
    "forge_dsl.printer": ("forge_dsl.spec.printer",),
    "forge_dsl.scalar_ops": ("forge_dsl.spec.scalar_ops",),
    "forge_dsl.checker": ("forge_dsl.spec.checker", "forge_dsl.spec.variants", "forge_dsl.spec.nonneg"),
    "forge_dsl.config": ("forge_dsl.spec.keywords", "forge_dsl.spec.variants"),
    # the compiler (forge_dsl.compiler)
    "forge_dsl.lowering": ("forge_dsl.compiler.lowering",),
    "forge_dsl.codegen": ("forge_dsl.compiler.codegen",),
    "forge_dsl.cli": ("forge_dsl.compiler.forge_gen",),
    "forge_dsl.templates": ("forge_dsl.compiler.templates",),
    "forge_dsl.kernels.compiled": ("forge_dsl.compiler.loader",),
    # the kernels (forge_dsl.kernels)
    "forge_dsl.layouts": ("forge_dsl.kernels.layouts",),
    "forge_dsl.kernels.launch": ("forge_dsl.kernels.steps",),
    "forge_dsl.kernels.launches": ("forge_dsl.kernels.kernel_calls",),
    "forge_dsl.kernels.prepared": ("forge_dsl.kernels.reuse",),
    "forge_dsl.kernels.sm90": ("forge_dsl.bench.sm90",),
    "forge_dsl.kernels.triton_lib": ("forge_dsl.kernels.tile_lib", "forge_dsl.kernels.state_lib",
                                     "forge_dsl.kernels.math_lib"),
    # training (forge_dsl.training)
    "forge_dsl.optim": ("forge_dsl.training.optimizer", "forge_dsl.training.installer"),
    "forge_dsl.fused_linear": ("forge_dsl.training.linear", "forge_dsl.training.installer",
                               "forge_dsl.training.weight"),
    "forge_dsl.fused_embedding": ("forge_dsl.training.embedding",),
    "forge_dsl.fused_head": ("forge_dsl.training.head_loss", "forge_dsl.training.hf_head"),
    "forge_dsl.row_updates": ("forge_dsl.training.row_updates",),
    "forge_dsl.consumed_grad": ("forge_dsl.training.consumed_grad",),
    "forge_dsl.tensor_parallel": ("forge_dsl.training.tensor_parallel",),
    "forge_dsl.offload": ("forge_dsl.training.offload",),
    "forge_dsl.checkpoint": ("forge_dsl.training.checkpoint",),
}

RENAMED: dict[tuple[str, str], tuple[str, str]] = {
    ("forge_dsl.config", "eval_host_expr"): ("forge_dsl.spec.variants", "evaluate"),
    ("forge_dsl.fused_linear", "fusion_refusal"): ("forge_dsl.training.installer", "fusion_refusal"),
    ("forge_dsl.optim", "fusion_refusal"): ("forge_dsl.training.installer", "fusion_refusal"),
}


def _moved_whole(old: str) -> bool:
    return len(ALIASES[old]) == 1 and not any(key[0] == old for key in RENAMED)


class _SplitModule(types.ModuleType):
    """An old module whose names now live in several modules: each attribute is looked up in them, in order."""

    def __init__(self, old: str) -> None:
        super().__init__(old, f"forge_dsl 0.1's {old}, now in {', '.join(ALIASES[old])}")
        self.__homes = tuple(importlib.import_module(m) for m in ALIASES[old])
        self.__all__ = sorted({n for m in self.__homes for n in getattr(m, "__all__", ())} |
                              {name for (module, name) in RENAMED if module == old})

    def __getattr__(self, name: str) -> Any:
        renamed = RENAMED.get((self.__name__, name))
        if renamed is not None:
            return getattr(importlib.import_module(renamed[0]), renamed[1])
        for home in self.__homes:
            if hasattr(home, name):
                return getattr(home, name)
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r} (it moved to "
                             f"{', '.join(ALIASES[self.__name__])})")

    def __dir__(self) -> list[str]:
        return sorted(set(self.__all__) | {n for home in self.__homes for n in dir(home)})


class _AliasLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        old = spec.name
        homes = ALIASES[old]
        where = homes[0] if len(homes) == 1 else f"{', '.join(homes[:-1])} and {homes[-1]}"
        warnings.warn(f"{old} moved to {where}; the old path goes in the next release",
                      DeprecationWarning, stacklevel=2)
        if _moved_whole(old):
            module = importlib.import_module(ALIASES[old][0])
            self._own_spec = module.__spec__  # the import system sets __spec__ to the alias's: put it back
            return module
        self._own_spec = None
        return _SplitModule(old)

    def exec_module(self, module: types.ModuleType) -> None:
        if self._own_spec is not None:
            module.__spec__ = self._own_spec


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Optional[types.ModuleType] = None):
        if fullname not in ALIASES:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(), is_package=fullname == "forge_dsl.templates")


_FINDER = _AliasFinder()


def install() -> None:
    """Serve the old paths (idempotent)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def attribute(package: str, name: str) -> types.ModuleType:
    """`package.name` for an old module path (a package's `__getattr__`).

    Raises:
        AttributeError: `package.name` is not an old path.
    """
    old = f"{package}.{name}"
    if old not in ALIASES:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return importlib.import_module(old)
