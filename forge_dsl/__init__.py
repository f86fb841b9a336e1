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

Module paths of forge_dsl 0.1 (`forge_dsl.codegen`, `forge_dsl.kernels.launch`, ...) still import, with a
DeprecationWarning, for one release (`forge_dsl.aliases`).
"""

from . import aliases

aliases.install()

from .api import builtin_names, init_state, load_spec  # noqa: E402
from .reference import reference_step  # noqa: E402
from .spec.errors import SpecError  # noqa: E402
from .spec.ir import Spec  # noqa: E402
from .training.offload import OffloadActivations  # noqa: E402
from .training.optimizer import ForgeOptimizer, fuse  # noqa: E402

__all__ = ["ForgeOptimizer", "OffloadActivations", "SpecError", "fuse", "Spec", "builtin_names", "init_state",
           "load_spec", "reference_step"]
__version__ = "0.1.0"


def __getattr__(name: str):
    """`forge_dsl.codegen` and the other 0.1 module paths, as attributes (`aliases.attribute`)."""
    return aliases.attribute(__name__, name)
