"""Stage 5: lowered programs → the text of a generated Triton module.

Python decides everything here (names, which values are kernel arguments,
how each operation is spelled in Triton and in host Python, which states a
variant loads) and hands the Jinja template (forge_dsl/templates/) plain
data; the template holds only structure.  Output is deterministic: no
timestamps, declaration order throughout.
"""

from __future__ import annotations

import functools
import hashlib
import math
import struct
from dataclasses import dataclass
from importlib import resources

import jinja2

from . import ir
from .checker import describe_combo
from .lowering import Instr, Lowered, Operand, lower_all

__all__ = ["render_module", "template_hash", "spec_hash", "TEMPLATE_NAMES", "GENERATOR_VERSION"]

TEMPLATE_NAMES = ("module.py.j2",)
GENERATOR_VERSION = "1"


def _template_text(name: str) -> str:
    return resources.files("forge_dsl.templates").joinpath(name).read_text()


@functools.lru_cache(maxsize=1)
def template_hash() -> str:
    h = hashlib.sha256(GENERATOR_VERSION.encode())
    for name in TEMPLATE_NAMES:
        h.update(_template_text(name).encode())
    return h.hexdigest()[:16]


def spec_hash(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FunctionLoader(_template_text),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )


# ----------------------------------------------------------------------------
# Spelling operations
# ----------------------------------------------------------------------------


def _float_literal(v: float) -> str:
    """A float64 literal of host code."""
    if math.isinf(v):
        return 'float("inf")' if v > 0 else 'float("-inf")'
    if math.isnan(v):
        return 'float("nan")'
    return repr(float(v))


def _fp32_literal(v: float) -> str:
    """A constant of kernel code, which computes in fp32: `v` rounded to fp32 (beyond its range, inf).

    Triton gives a literal in fp32's normal range (or 0, inf, NaN) the type fp32, and other literals
    fp64; so an fp32 subnormal is spelled as a cast, and a value that rounds to inf as inf."""
    try:
        r = struct.unpack("f", struct.pack("f", v))[0]
    except OverflowError:  # rounds to infinity
        r = math.copysign(math.inf, v)
    if r == 0.0 or not math.isfinite(r):
        return _float_literal(r)
    if abs(r) < 2.0**-126:
        return f"tl.cast({r!r}, tl.float32)"
    return _float_literal(v if 2.0**-126 <= abs(v) <= _FLT_MAX else r)


_FLT_MAX = 3.4028234663852886e38


def _host_operand(o: Operand) -> str:
    if o.kind == "const":
        return repr(o.value) if isinstance(o.value, bool) else _float_literal(o.value)
    if o.kind == "step":
        return "step"
    return o.name  # hyper, scalar and host values are local variables of the host function


_HOST_INFIX = {"add": "+", "sub": "-", "mul": "*", "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}


def _host_expr(instr: Instr) -> str:
    args = [_host_operand(a) for a in instr.args]
    if instr.op in _HOST_INFIX:
        return f"{args[0]} {_HOST_INFIX[instr.op]} {args[1]}"
    if instr.op == "neg":
        return f"-{args[0]}"
    if instr.op == "and":
        return f"{args[0]} and {args[1]}"
    if instr.op == "or":
        return f"{args[0]} or {args[1]}"
    if instr.op == "not":
        return f"not {args[0]}"
    return f'_op("{instr.op}", {", ".join(args)})'


def _elem_operand(o: Operand, bool_exports: set[str]) -> str:
    if o.kind == "const":
        return repr(o.value) if isinstance(o.value, bool) else _fp32_literal(o.value)
    if o.kind in ("param", "grad"):
        return f"b_{o.kind}"
    if o.kind == "state":
        return f"b_{o.name}"
    if o.kind == "elem":
        return f"v_{o.name}"
    name = "h_step" if o.kind == "step" else f"h_{o.name}"
    return f"({name} != 0)" if o.name in bool_exports else name


def _wrapped_args(args: list[str], indent: str, width: int = 110) -> str:
    """Call arguments, comma-separated, wrapped at `width` columns, each line starting with `indent`."""
    lines, line = [], indent
    for arg in args:
        piece = arg + ","
        if line.strip() and len(line) + 1 + len(piece) > width:
            lines.append(line)
            line = indent
        line = line + (" " if line.strip() else "") + piece
    lines.append(line)
    return "\n".join(lines)


def _int_power(base: str, n: int) -> str:
    """base ** n for an integer n >= 1 by multiplications: in a row up to 4, by squaring above."""
    if n <= 4:
        return " * ".join([base] * n)
    half = _int_power(base, n // 2)
    return f"({half}) * ({half})" + (f" * {base}" if n % 2 else "")


# Exact integer powers by multiplication up to this |exponent|; above it the general form (math_pow).
_MAX_INT_POWER = 32

# Functions spelled by a kernel-library helper (forge_dsl/kernels/triton_lib.py): op -> helper.
LIB_FUNCTIONS = {"pow": "math_pow", "atan": "math_atan", "atan2": "math_atan2", "tanh": "math_tanh",
                 "erf": "math_erf", "log1p": "math_log1p", "expm1": "math_expm1"}


def _splat(value: str, like: str) -> str:
    """`value` (a constant or host scalar) in every element of a tile shaped like `like`, exactly
    (`like * 0.0 + value` would be NaN where `like` is infinite)."""
    return f"tl.where({like} == {like}, {value}, {value})"


def _pow_expr(instr: Instr, a: list[str]) -> str:
    """`base ** exponent` with torch.pow's special values (docs/LANGUAGE.md, "Numbers")."""
    exponent = instr.args[1]
    base = a[0]
    if exponent.kind == "const" and instr.args[0].kind != "const":
        e = exponent.value
        if e == 0:  # 1 for every base, NaN and inf included
            return _splat("1.0", base)
        if math.isfinite(e) and e == int(e) and abs(e) <= _MAX_INT_POWER:
            if e > 0:
                return _int_power(base, int(e))
            return _int_power(f"tl.div_rn(1.0, {base})", int(-e))
        if e == 0.5:  # pow(-0, 0.5) = +0 and pow(-inf, 0.5) = inf, unlike sqrt
            return f'tl.where({base} == float("-inf"), float("inf"), tl.sqrt(tl.where({base} == 0, 0.0, {base})))'
        if e == -0.5:
            return f'tl.where({base} == float("-inf"), 0.0, tl.rsqrt(tl.where({base} == 0, 0.0, {base})))'
    return f"math_pow({', '.join(a)})"


def _elem_expr(instr: Instr, bool_exports: set[str]) -> str:
    a = [_elem_operand(x, bool_exports) for x in instr.args]
    op = instr.op
    infix = {"add": "+", "sub": "-", "mul": "*", "div": "/", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
             "eq": "==", "ne": "!=", "and": "&", "or": "|"}
    if op in infix:
        return f"{a[0]} {infix[op]} {a[1]}"
    if op == "neg":
        return f"-{a[0]}"
    if op == "not":
        return f"{a[0]} == 0"
    if op == "recip":
        return f"1.0 / {a[0]}"
    if op in ("sqrt", "rsqrt", "abs", "exp", "log"):
        return f"tl.{op}({a[0]})"
    if op == "sign":  # NaN stays NaN, +-0 stays +-0
        return f"tl.where({a[0]} > 0, 1.0, tl.where({a[0]} < 0, -1.0, {a[0]} * 0.0))"
    if op == "min":
        return f"tl.minimum({a[0]}, {a[1]}, propagate_nan=tl.PropagateNan.ALL)"
    if op == "max":
        return f"tl.maximum({a[0]}, {a[1]}, propagate_nan=tl.PropagateNan.ALL)"
    if op == "clamp":
        return (f"tl.minimum(tl.maximum({a[0]}, {a[1]}, propagate_nan=tl.PropagateNan.ALL), {a[2]}, "
                f"propagate_nan=tl.PropagateNan.ALL)")
    if op == "where":
        return f"tl.where({a[0]}, {a[1]}, {a[2]})"
    if op == "pow":
        return _pow_expr(instr, a)
    if op in LIB_FUNCTIONS:
        return f"{LIB_FUNCTIONS[op]}({', '.join(a)})"
    raise AssertionError(f"no Triton spelling for {op}")


# ----------------------------------------------------------------------------
# Template data
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Line:
    target: str
    expr: str


def _variant_data(spec: ir.Spec, index: int, low: Lowered) -> dict:
    states = list(low.states)
    host_bools = {i.name for i in low.host if i.type == "bool"}
    bool_exports = {o.name for o in low.exports if o.kind == "host" and o.name in host_bools}
    export_names = [o.name if o.kind != "step" else "step" for o in low.exports]
    host_lines = [_Line(i.name, _host_expr(i)) for i in low.host]
    returns = []
    for o in low.exports:
        text = _host_operand(o)
        if o.kind == "step":
            text = "float(step)"
        elif o.name in bool_exports:
            text = f"int({text})"
        returns.append(text)
    update_lines = [_Line(f"v_{i.name}", _elem_expr(i, bool_exports)) for i in low.elem]
    outputs = []
    for target, o in low.outputs:
        text = _elem_operand(o, bool_exports)
        if o.kind in ("const", "hyper", "step", "scalar", "host"):
            text = _splat(text, "b_param")  # a host value written to every element
        outputs.append(text)
    scalar_updates = [(name, _host_operand(o)) for name, o in low.scalar_updates]
    reads_scalars = sorted({a.name for i in low.host for a in i.args if a.kind == "scalar"}
                           | {o.name for _, o in low.scalar_updates if o.kind == "scalar"}
                           | {o.name for o in low.exports if o.kind == "scalar"})
    reads_hypers = [h.name for h in spec.hypers if
                    any(a.kind == "hyper" and a.name == h.name for i in low.host for a in i.args)
                    or any(o.kind == "hyper" and o.name == h.name for o in low.exports)
                    or any(o.kind == "hyper" and o.name == h.name for _, o in low.scalar_updates)]
    state_ptrs = [name for s in states for name in (f"S_{s}", f"SCALE_{s}")]
    exports = [f"h_{n}" for n in export_names]
    layouts = [f"LAYOUT_{s}" for s in states]
    common = ["n_blocks", "seed", "W_BF16", "STOCHASTIC"]

    raw = ["r_param"] + [name for s in states for name in (f"r_{s}", f"q_{s}")]

    def load_args(weight: str, indent: str, block_k: str = "BLOCK_K", block_n: str = "BLOCK_N",
                  prefix: str = "") -> str:
        return _wrapped_args(
            [weight, *state_ptrs, f"{prefix}offs", f"{prefix}mask", f"{prefix}scale_offs", "W_BF16", *layouts,
             block_n, block_k],
            indent,
        )

    def apply_args(weight: str, grad: str, indent: str, block_k: str = "BLOCK_K", block_n: str = "BLOCK_N") -> str:
        return _wrapped_args(
            [weight, *state_ptrs, *exports, grad, *raw, "offs", "mask", "scale_offs", "seed", "W_BF16",
             "STOCHASTIC", *layouts, block_n, block_k],
            indent,
        )

    def row_slice_args(grad: str, warps: str, indent: str) -> str:
        return _wrapped_args(["W", *state_ptrs, *exports, grad, "n_start + r * SLICE_N", "k_start", "N", "K",
                              "n_blocks", "seed", "W_BF16", "STOCHASTIC", *layouts, "SLICE_N", "BK", warps], indent)

    return {
        "raw": raw,
        "load_args": load_args("W", " " * 12),
        "load_args_slice": load_args("W", " " * 8, "SLICE_K"),
        "load_args_step": load_args("P", " " * 8),
        "apply_fused": apply_args("W", "acc", " " * 12),
        "apply_slice": apply_args("W", "acc", " " * 8, "SLICE_K"),
        # the fused kernel's calls of _slice_v<i>, for 2 and 4 slices: (accumulator slice, its first column)
        "slice_calls": {split: [_wrapped_args(["W", *state_ptrs, *exports, acc, "offs_n", k, "N", "K", *common,
                                               *layouts, "BLOCK_N", "SLICE_K"], " " * 16) for acc, k in slices]
                        for split, slices in ((2, [("acc_a", "k_start"), ("acc_b", "k_start + SLICE_K")]),
                                              (4, [(f"acc_{i}", f"k_start + {i} * SLICE_K" if i else "k_start")
                                                   for i in range(4)]))},
        "apply_step": apply_args("P", "b_grad", " " * 8),
        # the warp-specialized kernel: [SLICE_N, BK] row slices, prefetched by the epilogue partition ...
        "load_args_ws": load_args("W", " " * 16, "BK", "SLICE_N"),
        "load_args_ws_next": load_args("W", " " * 24, "BK", "SLICE_N", prefix="next_"),
        "next_raw": [f"next_{name}" for name in raw],
        "apply_ws": apply_args("W", "acc", " " * 20, "BK", "SLICE_N"),
        # ... or not (_row_slice_ws_v<i>, in either partition)
        "load_args_row_slice": load_args("W", " " * 8, "BK", "SLICE_N"),
        "apply_row_slice": apply_args("W", "b_grad", " " * 8, "BK", "SLICE_N"),
        "row_slice_args_epilogue": row_slice_args("acc", "EPILOGUE_WARPS", " " * 20),
        "row_slice_args_mma": row_slice_args("b_grad", "WARPS", " " * 16),
        "epilogue_ws_args": _wrapped_args(["W", *state_ptrs, *exports, "acc_smem", "acc_ready", "acc_empty", "seed",
                                           "N", "K", "n_blocks", "W_BF16", "STOCHASTIC", *layouts, "NUM_PROGRAMS",
                                           "GROUP_N", "SLICE_N", "EPILOGUE_WARPS", "PREFETCH", "MMA_SLICES"],
                                          " " * 12),
        "mma_ws_args": _wrapped_args(["X", "DY", "x_bufs", "dy_bufs", "ready", "empty", "acc_smem", "acc_ready",
                                      "acc_empty", "T", "W", *state_ptrs, *exports, "seed", "N", "K", "n_blocks",
                                      "W_BF16", "STOCHASTIC", *layouts, "NUM_PROGRAMS", "GROUP_N", "SLICE_N",
                                      "MMA_SLICES"], " " * 12),
        "index": index,
        "combo": describe_combo(low.combo) or "no flags",
        "combo_key": repr(tuple(low.combo)),
        "states": states,
        "exports": [f"h_{n}" for n in export_names],
        "host_hypers": reads_hypers,
        "host_scalars": reads_scalars,
        "host_lines": host_lines,
        "host_returns": returns,
        "scalar_updates": scalar_updates,
        "update_args": ["b_param", "b_grad"] + [f"b_{s}" for s in states],
        "update_targets": ["b_param"] + [f"b_{s}" for s in states],
        "update_lines": update_lines,
        "update_returns": outputs,
    }


def render_module(spec: ir.Spec, spec_path: str) -> str:
    """The generated module for `spec` (read from `spec_path`, a name shown in the header)."""
    variants = [_variant_data(spec, i, low) for i, low in enumerate(lower_all(spec))]
    lib_imports = ["accumulate_dw", "accumulate_dw_halves", "block_scale_offsets", "decode_weight", "load_weight",
                   "load_weight_raw", "split_columns", "store_weight", "tile_at", "tile_offsets"]
    if any(v["states"] for v in variants):
        lib_imports += ["decode_state", "load_state_raw", "store_state"]
    lib_imports += sorted({f for f in LIB_FUNCTIONS.values() for v in variants for line in v["update_lines"]
                           if f"{f}(" in line.expr})
    needs_op = any("_op(" in line.expr for v in variants for line in v["host_lines"])
    template = _environment().get_template("module.py.j2")
    return template.render(
        lib_imports=sorted(lib_imports),
        needs_op=needs_op,
        spec_name=spec.name,
        spec_doc=spec.doc or spec.name,
        spec_path=spec_path,
        spec_hash=spec_hash(spec.source),
        template_names=", ".join(TEMPLATE_NAMES),
        template_hash=template_hash(),
        flag_names=[f.name for f in spec.flags] + [d.name for d in spec.derived],
        all_states=[s.name for s in spec.states],
        variants=variants,
    )
