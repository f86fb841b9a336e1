"""FORGE-DSL: optimizers written as `.fopt` specs, compiled to tile-fused Triton kernels.

    >>> import forge_dsl
    >>> spec = forge_dsl.load_spec("adamw")
    >>> state = forge_dsl.init_state(spec, param)
    >>> forge_dsl.reference_step(spec, param, grad, state, step=1, lr=1e-3)
    >>> opt = forge_dsl.ForgeOptimizer(model, "adamw", lr=1e-3)

The package's layers, each importing only those above it (docs/ARCHITECTURE.md):

    spec/       the language: parse, check, variants, keywords (no torch)
    compiler/   lowering, code generation, the generated modules' loader, forge-gen (no torch)
    reference   the float64 reference step (torch)
    kernels/    the Triton kernels and their host side
    api         load_spec, init_state
    training/   ForgeOptimizer and what it installs on a model
    testing/, bench/   forge-test and forge-bench

The names below are imported on first use, so the language and the compiler (`forge-gen`) run without torch.
Module paths of forge_dsl 0.1 (`forge_dsl.codegen`, `forge_dsl.kernels.launch`, ...) still import, with a
DeprecationWarning, for one release (`forge_dsl.aliases`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from . import aliases

aliases.install()

__all__ = ["CapturedStep", "ForgeOptimizer", "ForgeTrainer", "OffloadActivations", "SpecError", "fuse", "Spec", "builtin_names", "init_state",
           "load_spec", "reference_step"]
__version__ = "0.1.0"

# Each public name and the module that defines it.
_PUBLIC = {
    "CapturedStep": "forge_dsl.training.captured",
    "ForgeOptimizer": "forge_dsl.training.optimizer",
    "ForgeTrainer": "forge_dsl.training.hf_trainer",  # needs transformers
    "fuse": "forge_dsl.training.installer",
    "OffloadActivations": "forge_dsl.training.offload",
    "SpecError": "forge_dsl.spec.errors",
    "Spec": "forge_dsl.spec.ir",
    "builtin_names": "forge_dsl.spec.loading",
    "load_spec": "forge_dsl.spec.loading",
    "init_state": "forge_dsl.api",
    "reference_step": "forge_dsl.reference",
}

if TYPE_CHECKING:
    from .api import init_state
    from .reference import reference_step
    from .spec.errors import SpecError
    from .spec.ir import Spec
    from .spec.loading import builtin_names, load_spec
    from .training.captured import CapturedStep
    from .training.installer import fuse
    from .training.offload import OffloadActivations
    from .training.optimizer import ForgeOptimizer


def __getattr__(name: str):
    """A public name (imported on first use and kept), or a 0.1 module path (`aliases.attribute`)."""
    home = _PUBLIC.get(name)
    if home is None:
        return aliases.attribute(__name__, name)
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
