"""The generated kernels' stable Python API.

    forge_dsl.kernels.fused_linear_step(spec, x, dy, weight, state, step=t, **hypers)
    forge_dsl.kernels.slab_linear_step(spec, x, dy, weight, state, step=t, **hypers)
    forge_dsl.kernels.linear_step(spec, x, dy, weight, state, step=t, path="auto", **hypers)
    forge_dsl.kernels.step(spec, param, grad, state, step=t, **hypers)
    forge_dsl.kernels.foreach_step(spec, params, grads, states, step=t, **hypers)   # one launch for many

`spec` is a built-in name, a path to a `.fopt`, or a loaded spec; hypers use
torch's keyword names (`betas=(0.9, 0.999)` included); `state` is what
`forge_dsl.init_state(spec, param, layout=...)` returns.
"""

from .foreach import foreach_step
from .kernel_calls import mix_seed
from .policy import TileConfig
from .steps import ParamUpdate, fused_linear_step, linear_step, slab_linear_step, step

__all__ = ["ParamUpdate", "TileConfig", "foreach_step", "fused_linear_step", "linear_step", "mix_seed",
           "slab_linear_step", "step"]


def __getattr__(name: str):
    """`forge_dsl.kernels.launch` and the other 0.1 module paths, as attributes (`forge_dsl.aliases`)."""
    from .. import aliases

    return aliases.attribute(__name__, name)
