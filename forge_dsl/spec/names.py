"""The names the language gives a meaning or keeps from specs: its built-in functions and values, the
reductions it refuses (and the hint it gives for them), and the names reserved because Python, Triton, the generated code, the Python API or
torch's schedulers would take them (docs/LANGUAGE.md, section 10). The checker enforces them."""

from __future__ import annotations

import keyword

__all__ = ["API_KEYWORDS", "BARRIER_FUNCTIONS", "BUILTIN_FUNCTIONS", "BUILTIN_VALUES", "COLLIDING_NAMES",
           "NOT_ELEMENT_WISE_HINT", "PER_TENSOR_FUNCTIONS", "REDUCTIONS", "RESERVED_NAMES", "ROW_COLUMN_FUNCTIONS",
           "SCHEDULER_KEYS", "SHAPE_VALUES", "STATE_EXTENTS"]

# name -> number of arguments
BUILTIN_FUNCTIONS = {
    "sqrt": 1,
    "rsqrt": 1,
    "abs": 1,
    "sign": 1,
    "exp": 1,
    "log": 1,
    "atan": 1,
    "atan2": 2,
    "tanh": 1,
    "erf": 1,
    "log1p": 1,
    "expm1": 1,
    "min": 2,
    "max": 2,
    "clamp": 3,
    "where": 3,
    "stored": 1,  # per element whatever its argument (ir.ELEMENT_FUNCTIONS)
}

# Functions of the whole weight that split an update into phases (spec/phases.py): name -> number of arguments.
# orthogonalize(x, steps, a, b, c, eps): torch.optim.Muon's Newton-Schulz iteration of the matrix x, in bfloat16;
# norm(x), sum(x), mean(x): the 2-norm, sum and mean of x's numbers (one value per tensor); rowmean(x), colmean(x):
# the mean of each row (one value per row) and of each column (one per column) of x, the weight seen as a matrix.
BARRIER_FUNCTIONS = {
    "orthogonalize": 6,
    "norm": 1,
    "sum": 1,
    "mean": 1,
    "rowmean": 1,
    "colmean": 1,
}
PER_TENSOR_FUNCTIONS = frozenset({"norm", "sum", "mean"})
# reduction -> the extent of its result (spec/extents.py)
ROW_COLUMN_FUNCTIONS = {"rowmean": "rows", "colmean": "cols"}
# What a state may be besides per element: `state r[rows] = 0` (one value per row), `state c[cols] = 0`.
STATE_EXTENTS = ("rows", "cols")

# Functions a user may reach for that combine several elements (the matrix functions of Muon and Shampoo and the
# row / column statistics of Adafactor among them).
REDUCTIONS = {
    "prod", "dot", "std", "var", "amax", "amin", "argmax", "argmin",
    "cumsum", "cumprod", "matmul", "mm", "numel", "size", "softmax", "logsumexp", "median",
    "topk", "sort", "roll", "shift", "outer", "trace", "any", "all", "count",
    "rms", "rowsum", "colsum", "newton_schulz", "zeropower", "svd", "qr",
    "inverse", "eigh", "transpose",
}

# What a spec that reaches for a reduction or a matrix product is told (the checker's and the parser's hint).
NOT_ELEMENT_WISE_HINT = (
    "the update runs inside backward on each tile of the weight while its gradient is in registers, before the "
    "weight's other tiles exist, so nothing computed over the whole tensor can reach it (nor a hyperparameter "
    "computed from this step's gradient: the update has run before step()). Clipping by the global norm: "
    "ForgeOptimizer(..., max_grad_norm=c) around any spec. A norm, sum or mean over the tensor, or Muon's "
    "orthogonalize(), or the mean of each row or column (rowmean, colmean, into a state declared 'state r[rows] = "
    "0'), as a statement of its own ('n = norm(x)'), splits the update into phases (docs/LANGUAGE.md section 9.1; "
    "the built-in specs 'muon', 'lamb' and 'adafactor'). Shampoo, per-block moments: not expressible yet; train "
    "with their PyTorch implementation stepping from .grad (ForgeOptimizer(..., fuse=False))"
)

BUILTIN_VALUES = ("param", "grad", "step")
# One value per tensor, from the weight: `rows` = size(0), `cols` = the product of the other sizes, `ndim` = its
# number of dimensions, `param_eps` = the machine epsilon of the dtype it is stored in (torch.finfo(dtype).eps).
SHAPE_VALUES = ("rows", "cols", "ndim", "param_eps")

# Names that would collide with Python (keyword arguments of the generated
# launchers), Triton or the generated code's own names.
COLLIDING_NAMES = frozenset(
    set(keyword.kwlist)
    | set(getattr(keyword, "softkwlist", ()))
    | {"tl", "triton", "torch", "math", "np", "numpy", "libdevice", "self", "cls"}
    | {"spec", "state", "weight", "x", "dy", "seed", "layout", "rounding", "grid", "kernel", "meta"}
    | {"int", "float", "bool", "len", "range", "print", "min_", "max_"}
)
# The named parameters of the Python API's entry points (kernels.fused_linear_step, slab_linear_step,
# linear_step, step, kernels.foreach, init_state, reference_step, ForgeOptimizer), which take the
# spec's keywords as **hypers: a hyperparameter or flag of the same name would be taken by the API.
# tests/spec/test_reserved_names.py keeps this in step with their signatures.
API_KEYWORDS = frozenset({
    "spec", "param", "grad", "step", "state", "states", "params", "grads", "weight", "x", "dy", "model",
    "seed", "rounding", "layout", "state_dtype", "fuse", "foreach", "linear_path", "path", "tf32", "config",
    "slab_bytes", "initial_hypers", "self", "model_params", "lm_head_loss", "weight_dtype", "max_grad_norm",
    "accumulation_steps", "accumulation_dtype", "capturable", "host_row",
})
# The keys torch's learning-rate schedulers and SWA write into a param group beside lr, momentum and betas (which
# they schedule on purpose): a hyperparameter of the same name would be replaced by their value.
# tests/spec/test_reserved_names.py reads torch.optim's source to keep this complete.
SCHEDULER_KEYS = frozenset({"initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum", "swa_lr",
                            "param_names"})
RESERVED_NAMES = COLLIDING_NAMES | API_KEYWORDS | SCHEDULER_KEYS
