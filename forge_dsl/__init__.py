"""FORGE-DSL: optimizers written as `.fopt` specs, compiled to tile-fused Triton kernels.

    >>> import forge_dsl
    >>> spec = forge_dsl.load_spec("adamw")
    >>> state = forge_dsl.init_state(spec, param)
    >>> forge_dsl.reference_step(spec, param, grad, state, step=1, lr=1e-3)
"""

from .api import builtin_names, init_state, load_spec
from .errors import SpecError
from .ir import Spec
from .offload import OffloadActivations
from .optim import ForgeOptimizer, fuse
from .reference import reference_step

__all__ = ["ForgeOptimizer", "OffloadActivations", "SpecError", "fuse", "Spec", "builtin_names", "init_state",
           "load_spec", "reference_step"]
__version__ = "0.1.0"
