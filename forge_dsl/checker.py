"""Stage 2: semantic checks on a parsed `ir.Spec`.

What is checked, each with a located `SpecError`:
  * names: duplicates, reserved words, unknown names (with a suggestion);
  * types: numbers vs booleans (a flag used as a number, a number used as a
    condition), function names and arities;
  * element-wise-ness: indexing, attributes and reductions cannot be written;
  * assignments: hyperparameters, flags, `grad` and `step` are read-only; scalar
    state takes only per-tensor values; states exist only where their condition
    holds;
  * data flow, for every combination of flags: temporaries are assigned before
    they are read, and `param` and every state are updated.

Flags select code at compile time, so the body is checked once per
combination of flag values (`combinations`), after `specialize` has resolved
each `if`.  The lowering stage reuses both.
"""

from __future__ import annotations

import enum
import itertools
import keyword
import math
from dataclasses import dataclass
from typing import Iterator, Optional

from . import ir
from .errors import Loc, SpecError, did_you_mean
from .printer import print_expr
from .scalar_ops import apply_scalar_op

__all__ = [
    "BUILTIN_FUNCTIONS",
    "Combo",
    "Level",
    "Type",
    "check_spec",
    "combinations",
    "describe_combo",
    "eval_static",
    "specialize",
]

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
}

# Functions a user may reach for that combine several elements.
REDUCTIONS = {
    "sum", "mean", "norm", "prod", "dot", "std", "var", "amax", "amin", "argmax", "argmin",
    "cumsum", "cumprod", "matmul", "mm", "numel", "size", "softmax", "logsumexp", "median",
    "topk", "sort", "roll", "shift", "outer", "trace", "any", "all", "count",
}

BUILTIN_VALUES = ("param", "grad", "step")

# Names that would collide with Python (keyword arguments of the generated
# launchers), Triton or the generated code's own names.
RESERVED_NAMES = frozenset(
    set(keyword.kwlist)
    | set(getattr(keyword, "softkwlist", ()))
    | {"tl", "triton", "torch", "math", "np", "numpy", "libdevice", "self", "cls"}
    | {"spec", "state", "weight", "x", "dy", "seed", "layout", "rounding", "grid", "kernel", "meta"}
    | {"int", "float", "bool", "len", "range", "print", "min_", "max_"}
)

MAX_FLAGS = 8

# How messages name a symbol of each kind ("'grad' is the gradient; ...").
_KIND_PHRASES = {
    "param": "the parameter (a per-element value)",
    "grad": "the gradient (a per-element value)",
    "step": "the step counter",
    "state": "a state",
    "scalar state": "a scalar state",
    "tuple keyword": "a tuple keyword",
}


class Type(enum.Enum):
    REAL = "number"
    BOOL = "boolean"


class Level(enum.IntEnum):
    """How often a value changes: the lowering hoists everything below ELEMENT."""

    CONST = 0  # a literal
    FLAG = 1  # fixed when the kernel is compiled
    HOST = 2  # once per step per tensor (hyperparameters, step, scalar state)
    ELEMENT = 3  # per element (param, grad, state)


Combo = tuple[tuple[str, bool], ...]


def combinations(spec: ir.Spec) -> list[Combo]:
    """Every assignment of True/False to the flags and derived flags, in declaration order."""
    names = [f.name for f in spec.flags] + [d.name for d in spec.derived]
    return [tuple(zip(names, values)) for values in itertools.product((False, True), repeat=len(names))]


def describe_combo(combo: Combo) -> str:
    return ", ".join(f"{name}={'true' if value else 'false'}" for name, value in combo)


def eval_static(expr: ir.Expr, flags: dict[str, bool]) -> bool:
    """Evaluate a compile-time boolean: flags and literals, combined by any operator or function."""
    return bool(_static_value(expr, flags))


def _static_value(expr: ir.Expr, flags: dict[str, bool]):
    if isinstance(expr, (ir.BoolLit, ir.Num)):
        return expr.value
    if isinstance(expr, ir.Name):
        return flags[expr.id]
    if isinstance(expr, ir.Unary):
        return apply_scalar_op(expr.op, _static_value(expr.operand, flags))
    if isinstance(expr, ir.Binary):
        return apply_scalar_op(expr.op, _static_value(expr.left, flags), _static_value(expr.right, flags))
    if isinstance(expr, ir.Call):
        return apply_scalar_op(expr.func, *(_static_value(a, flags) for a in expr.args))
    raise AssertionError(f"not a compile-time condition: {expr!r}")


def specialize(body: tuple[ir.Stmt, ...], flags: dict[str, bool]) -> list[ir.Assign]:
    """The straight-line assignments that run when the flags have these values."""
    out: list[ir.Assign] = []
    for stmt in body:
        if isinstance(stmt, ir.Assign):
            out.append(stmt)
        elif eval_static(stmt.condition, flags):
            out.extend(specialize(stmt.then, flags))
        else:
            out.extend(specialize(stmt.orelse, flags))
    return out


def states_present(spec: ir.Spec, flags: dict[str, bool]) -> tuple[ir.State, ...]:
    """The states that exist when the flags have these values."""
    return tuple(s for s in spec.states if s.condition is None or eval_static(s.condition, flags))


# ----------------------------------------------------------------------------
# The checker
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Symbol:
    kind: str  # hyper, group, flag, derived, state, scalar, param, grad, step, temp
    type: Type
    level: Level


def _walk_stmts(body) -> Iterator[ir.Stmt]:
    for stmt in body:
        yield stmt
        if isinstance(stmt, ir.If):
            yield from _walk_stmts(stmt.then)
            yield from _walk_stmts(stmt.orelse)


def _describe(expr: ir.Expr) -> str:
    """A short quote of an expression for messages."""
    if isinstance(expr, ir.Name):
        return f"'{expr.id}'"
    if isinstance(expr, ir.Num):
        return f"'{ir.format_number(expr.value)}'"
    if isinstance(expr, ir.BoolLit):
        return "'true'" if expr.value else "'false'"
    if isinstance(expr, ir.Call):
        return f"'{expr.func}(...)'"
    return "this expression"


class _Checker:
    def __init__(self, spec: ir.Spec) -> None:
        self.spec = spec
        self.symbols: dict[str, _Symbol] = {}
        self.used: set[str] = set()
        self.temps_anywhere = {
            s.target
            for s in _walk_stmts(spec.body)
            if isinstance(s, ir.Assign)
        }

    def error(self, message: str, loc: Loc, hint: Optional[str] = None) -> SpecError:
        return SpecError(message, loc, self.spec.source, hint)

    # -- declarations ------------------------------------------------------
    def declare(self, name: str, symbol: _Symbol, loc: Loc) -> None:
        if name in BUILTIN_VALUES:
            raise self.error(f"'{name}' is built in and cannot be declared", loc)
        if name in BUILTIN_FUNCTIONS:
            raise self.error(f"'{name}' is a built-in function and cannot be declared", loc)
        self.check_name(name, loc)
        if name in self.symbols:
            raise self.error(f"duplicate name '{name}': it is already declared as a {self.symbols[name].kind}", loc)
        self.symbols[name] = symbol

    def check_name(self, name: str, loc: Loc) -> None:
        if name in RESERVED_NAMES:
            raise self.error(
                f"'{name}' is reserved (it would collide with Python, Triton or generated code); choose another name",
                loc,
            )
        if name.startswith("_") or "__" in name:
            raise self.error(
                f"name '{name}' may not start with '_' or contain '__' (reserved for generated code)", loc
            )

    def check_declarations(self) -> None:
        spec = self.spec
        self.symbols = {
            "param": _Symbol("param", Type.REAL, Level.ELEMENT),
            "grad": _Symbol("grad", Type.REAL, Level.ELEMENT),
            "step": _Symbol("step", Type.REAL, Level.HOST),
        }
        self.check_name(spec.name, spec.loc)
        members = {m for g in spec.groups for m in g.members}
        groups = {g.name: g for g in spec.groups}
        # In source order, so that a duplicate is reported where it is written
        # a second time (a tuple keyword is declared just before its members).
        for h in spec.hypers:
            if h.group is not None and h.group not in self.symbols:
                g = groups[h.group]
                self.declare(g.name, _Symbol("tuple keyword", Type.REAL, Level.HOST), g.loc)
                self.check_interval(g.interval, g.name, g.loc)
            self.declare(h.name, _Symbol("hyperparameter", Type.REAL, Level.HOST), h.loc)
            iv = h.interval
            if h.group is None:
                self.check_interval(iv, h.name, h.loc)
            if h.default is not None and not iv.contains(h.default):
                raise self.error(
                    f"the default {ir.format_number(h.default)} of '{h.name}' is outside its range {iv}", h.loc
                )
        for f in spec.flags:
            self.declare(f.name, _Symbol("flag", Type.BOOL, Level.FLAG), f.loc)
        for d in spec.derived:
            t, level = self.infer_declaration_expr(
                d.expr, allowed=("hyperparameter", "flag", "derived flag"), what=f"flag '{d.name}'"
            )
            if t is not Type.BOOL:
                raise self.error(
                    f"flag '{d.name}' must be true, false or a condition on hyperparameters, not a number",
                    d.expr.loc,
                )
            self.declare(d.name, _Symbol("derived flag", Type.BOOL, Level.FLAG), d.loc)
        all_flags = list(spec.flags) + list(spec.derived)
        if len(all_flags) > MAX_FLAGS:
            raise self.error(
                f"too many flags: at most {MAX_FLAGS} are supported (each doubles the compiled variants)",
                all_flags[MAX_FLAGS].loc,
            )
        for s in spec.states:
            self.declare(s.name, _Symbol("state", Type.REAL, Level.ELEMENT), s.loc)
            self.check_initial_value(s.init, s.name)
            if s.condition is not None:
                self.check_compile_time_condition(s.condition, f"the condition of state '{s.name}'")
        for s in spec.scalars:
            self.declare(s.name, _Symbol("scalar state", Type.REAL, Level.HOST), s.loc)
            self.check_initial_value(s.init, s.name)
        for r in spec.requires:
            t, _ = self.infer_declaration_expr(
                r.condition, allowed=("hyperparameter", "flag", "derived flag"), what="a 'require' condition"
            )
            if t is not Type.BOOL:
                raise self.error("a 'require' condition must be a boolean", r.condition.loc,
                                 hint="compare it, e.g. 'x > 0'")
        # Kinds are fixed now; rename the member symbols' kind for messages.
        for m in members:
            self.symbols[m] = _Symbol("hyperparameter", Type.REAL, Level.HOST)

    def check_interval(self, iv: ir.Interval, name: str, loc: Loc) -> None:
        if iv.low > iv.high or (iv.low == iv.high and not (iv.low_closed and iv.high_closed)):
            raise self.error(f"the range {iv} of '{name}' is empty", loc)

    def check_initial_value(self, init: ir.Expr, name: str) -> None:
        if isinstance(init, ir.Num):
            return
        if isinstance(init, ir.Unary) and init.op == "neg" and isinstance(init.operand, ir.Num):
            return
        if isinstance(init, ir.Name) and self.symbols.get(init.id, _Symbol("", Type.REAL, Level.CONST)).kind == "hyperparameter":
            self.used.add(init.id)
            return
        if isinstance(init, ir.Name) and init.id not in self.symbols and init.id not in BUILTIN_FUNCTIONS:
            raise self.error(
                f"unknown name '{init.id}' in the initial value of '{name}'"
                + did_you_mean(init.id, [h.name for h in self.spec.hypers]),
                init.loc,
            )
        raise self.error(
            f"the initial value of '{name}' must be a number or a hyperparameter", init.loc
        )

    def infer_declaration_expr(self, expr: ir.Expr, allowed: tuple[str, ...], what: str) -> tuple[Type, Level]:
        """Type a derived flag or a 'require' (`what`, for messages): keywords only."""
        declared_later = {s.name: "a state" for s in self.spec.states}
        declared_later.update({s.name: "a scalar state" for s in self.spec.scalars})
        declared_later.update({d.name: "a flag" for d in self.spec.derived})
        for n in _iter_names(expr):
            sym = self.symbols.get(n.id)
            if sym is not None and (sym.kind in allowed or sym.kind == "tuple keyword"):
                continue  # allowed, or reported by infer() below with a better message
            if sym is not None:
                kind = _KIND_PHRASES.get(sym.kind, f"a {sym.kind}")
            elif n.id in declared_later:
                kind = declared_later[n.id]
                if kind == "a flag":
                    raise self.error(f"flag '{n.id}' is used before it is declared", n.loc,
                                     hint="declare it above this line")
            elif n.id in self.temps_anywhere:
                kind = "a temporary of the update"
            else:
                continue  # unknown: reported by infer() below, with a suggestion
            raise self.error(
                f"'{n.id}' is {kind}; {what} may use only hyperparameters and flags", n.loc,
                hint="it is evaluated once, from the keywords, before any step",
            )
        return self.infer(expr, env=set(), defined_somewhere=set())

    def check_compile_time_condition(self, cond: ir.Expr, what: str) -> None:
        for n in _iter_names(cond):
            if n.id not in self.symbols and n.id in self.temps_anywhere:
                raise self.error(
                    f"{what} is resolved when the kernel is compiled, so it may use only flags, "
                    f"not the temporary '{n.id}'",
                    n.loc,
                    hint="for a per-step or per-element choice, use where(condition, a, b) in the update",
                )
        t, level = self.infer(cond, env=set(), defined_somewhere=set())
        if t is not Type.BOOL:
            raise self.error(f"{what} must be a boolean made of flags", cond.loc)
        if level > Level.FLAG:
            raise self.error(
                f"{what} is resolved when the kernel is compiled, so it may use only flags",
                cond.loc,
                hint="for a per-step or per-element choice, use where(condition, a, b) in the update",
            )

    # -- expressions -------------------------------------------------------
    def infer(self, expr: ir.Expr, env: set[str], defined_somewhere: set[str], why: str = "") -> tuple[Type, Level]:
        """(type, level) of `expr`; `env` holds the temporaries assigned so far."""
        if isinstance(expr, ir.Num):
            return Type.REAL, Level.CONST
        if isinstance(expr, ir.BoolLit):
            return Type.BOOL, Level.CONST
        if isinstance(expr, ir.Name):
            return self.infer_name(expr, env, defined_somewhere, why)
        if isinstance(expr, ir.Index):
            raise self.error(
                "indexing is not element-wise: an element's update may read only its own param, grad and state",
                expr.loc,
            )
        if isinstance(expr, ir.Attribute):
            raise self.error(
                f"'.{expr.attr}' is not allowed: an element's update may read only its own param, grad and state, "
                "through the built-in functions",
                expr.loc,
            )
        if isinstance(expr, ir.Unary):
            t, level = self.infer(expr.operand, env, defined_somewhere, why)
            if expr.op == "neg":
                self.expect_real(expr.operand, t, "'-'")
                return Type.REAL, level
            self.expect_bool(expr.operand, t, "'not'")
            return Type.BOOL, level
        if isinstance(expr, ir.Binary):
            lt, ll = self.infer(expr.left, env, defined_somewhere, why)
            rt, rl = self.infer(expr.right, env, defined_somewhere, why)
            level = max(ll, rl)
            if expr.op in ir.ARITHMETIC_OPS:
                symbol = {"add": "+", "sub": "-", "mul": "*", "div": "/", "pow": "**"}[expr.op]
                self.expect_real(expr.left, lt, f"'{symbol}'")
                self.expect_real(expr.right, rt, f"'{symbol}'")
                return Type.REAL, level
            if expr.op in ir.COMPARISON_OPS:
                if expr.op in ("eq", "ne") and lt is Type.BOOL and rt is Type.BOOL:
                    return Type.BOOL, level
                symbol = {v: k for k, v in ir.COMPARE_SYMBOLS.items()}[expr.op]
                self.expect_real(expr.left, lt, f"'{symbol}'")
                self.expect_real(expr.right, rt, f"'{symbol}'")
                return Type.BOOL, level
            self.expect_bool(expr.left, lt, f"'{expr.op}'")
            self.expect_bool(expr.right, rt, f"'{expr.op}'")
            return Type.BOOL, level
        if isinstance(expr, ir.Call):
            return self.infer_call(expr, env, defined_somewhere, why)
        raise AssertionError(expr)

    def infer_name(self, expr: ir.Name, env, defined_somewhere, why) -> tuple[Type, Level]:
        name = expr.id
        if name in env:
            return env[name] if isinstance(env, dict) else (Type.REAL, Level.ELEMENT)
        sym = self.symbols.get(name)
        if sym is None:
            if name in defined_somewhere:
                raise self.error(f"temporary '{name}' is read before it is assigned{why}", expr.loc)
            if name in BUILTIN_FUNCTIONS:
                raise self.error(f"'{name}' is a function; call it as {name}(...)", expr.loc)
            candidates = list(self.symbols) + list(env)
            raise self.error(f"unknown name '{name}'" + did_you_mean(name, candidates), expr.loc)
        if sym.kind == "tuple keyword":
            members = next(g.members for g in self.spec.groups if g.name == name)
            raise self.error(
                f"'{name}' is a tuple keyword; use its members " + ", ".join(f"'{m}'" for m in members),
                expr.loc,
            )
        self.used.add(name)
        return sym.type, sym.level

    def infer_call(self, expr: ir.Call, env, defined_somewhere, why) -> tuple[Type, Level]:
        func = expr.func
        if func not in BUILTIN_FUNCTIONS:
            if func in REDUCTIONS:
                raise self.error(
                    f"'{func}' combines several elements and is not element-wise; "
                    "an element's update may read only its own param, grad and state",
                    expr.func_loc,
                )
            if func in self.symbols or func in env:
                raise self.error(f"'{func}' is not a function", expr.func_loc)
            raise self.error(
                f"unknown function '{func}'" + did_you_mean(func, BUILTIN_FUNCTIONS), expr.func_loc,
                hint=None if did_you_mean(func, BUILTIN_FUNCTIONS) else "the functions are " + ", ".join(sorted(BUILTIN_FUNCTIONS)),
            )
        arity = BUILTIN_FUNCTIONS[func]
        if len(expr.args) != arity:
            raise self.error(
                f"{func}() takes {arity} argument{'s' if arity != 1 else ''}, got {len(expr.args)}", expr.loc
            )
        typed = [self.infer(a, env, defined_somewhere, why) for a in expr.args]
        level = max((lv for _, lv in typed), default=Level.CONST)
        if func == "where":
            (ct, _), (at, _), (bt, _) = typed
            self.expect_bool(expr.args[0], ct, "the condition of where()")
            if at is not bt:
                raise self.error("the two branches of where() must both be numbers or both be booleans", expr.loc)
            return at, level
        for arg, (t, _) in zip(expr.args, typed):
            self.expect_real(arg, t, f"{func}()")
        return Type.REAL, level

    def expect_real(self, expr: ir.Expr, t: Type, where: str) -> None:
        if t is Type.REAL:
            return
        if isinstance(expr, ir.Name) and self.symbols.get(expr.id, _Symbol("", t, Level.CONST)).kind in ("flag", "derived flag"):
            raise self.error(
                f"flag '{expr.id}' is a boolean and cannot be used as a number in {where}",
                expr.loc,
                hint=f"choose between two values with where({expr.id}, a, b)",
            )
        raise self.error(f"{_describe(expr)} is a boolean; {where} needs a number", expr.loc)

    def expect_bool(self, expr: ir.Expr, t: Type, where: str) -> None:
        if t is Type.BOOL:
            return
        raise self.error(
            f"{_describe(expr)} is a number; {where} needs a boolean",
            expr.loc,
            hint="compare it, e.g. 'x > 0'",
        )

    # -- the body ----------------------------------------------------------
    def check_body_structure(self) -> None:
        """Checks that do not depend on flag values: targets, if-conditions, expression types."""
        for stmt in _walk_stmts(self.spec.body):
            if isinstance(stmt, ir.If):
                self.check_compile_time_condition(stmt.condition, "an 'if' condition")
                continue
            target = stmt.target
            sym = self.symbols.get(target)
            if sym is None:
                if target in BUILTIN_FUNCTIONS:
                    raise self.error(f"'{target}' is a built-in function and cannot be assigned", stmt.target_loc)
                self.check_name(target, stmt.target_loc)
                continue
            if sym.kind in ("hyperparameter", "tuple keyword"):
                raise self.error(
                    f"cannot assign to hyperparameter '{target}': hyperparameters are read-only",
                    stmt.target_loc,
                    hint=f"assign to a temporary instead, e.g. '{target}_t = ...'",
                )
            if sym.kind in ("flag", "derived flag"):
                raise self.error(f"cannot assign to flag '{target}': flags are read-only", stmt.target_loc)
            if sym.kind == "grad":
                raise self.error(
                    "cannot assign to 'grad': the gradient is read-only",
                    stmt.target_loc,
                    hint="assign to a temporary instead, e.g. 'g = ...'",
                )
            if sym.kind == "step":
                raise self.error("cannot assign to 'step': the step counter is read-only", stmt.target_loc)

    def check_combination(self, combo: Combo, qualify: bool) -> None:
        flags = dict(combo)
        why = f" (when {describe_combo(combo)})" if qualify and combo else ""
        present = {s.name for s in states_present(self.spec, flags)}
        env: dict[str, tuple[Type, Level]] = {}
        assigned: set[str] = set()
        for stmt in specialize(self.spec.body, flags):
            sym_env = dict(env)
            t, level = self.infer(stmt.value, sym_env, self.temps_anywhere, why)
            for n in _iter_names(stmt.value):
                if self.symbols.get(n.id) and self.symbols[n.id].kind == "state" and n.id not in present:
                    raise self.error(self.absent_state_message(n.id, why), n.loc)
            target = stmt.target
            sym = self.symbols.get(target)
            if sym is None:  # a temporary
                env[target] = (t, level)
                continue
            if t is not Type.REAL:
                what = f"'{target}'" if sym.kind == "param" else f"{sym.kind} '{target}'"
                raise self.error(f"cannot assign a boolean to {what}", stmt.value.loc)
            if sym.kind == "state" and target not in present:
                raise self.error(self.absent_state_message(target, why), stmt.target_loc)
            if sym.kind == "scalar state" and level > Level.HOST:
                raise self.error(
                    f"scalar state '{target}' holds one value per tensor, but this value differs per element"
                    " (it depends on param, grad or a state)",
                    stmt.value.loc,
                )
            assigned.add(target)
        if "param" not in assigned:
            raise self.error(f"the update never assigns 'param'{why}", self.spec.loc,
                             hint="end the update with 'param = ...'")
        for s in self.spec.states:
            if s.name in present and s.name not in assigned:
                raise self.error(f"state '{s.name}' is never updated{why}", s.loc,
                                 hint="remove it or assign it in the update")
        for s in self.spec.scalars:
            if s.name not in assigned:
                raise self.error(f"scalar state '{s.name}' is never updated{why}", s.loc,
                                 hint="remove it or assign it in the update")

    def absent_state_message(self, name: str, why: str) -> str:
        state = next(s for s in self.spec.states if s.name == name)
        return f"state '{name}' does not exist here{why}: it is declared only if {print_expr(state.condition)}"

    def check_unused(self) -> None:
        for h in self.spec.hypers:
            if h.name not in self.used:
                raise self.error(f"hyperparameter '{h.name}' is never used", h.loc, hint="remove it or use it")
        for f in list(self.spec.flags) + list(self.spec.derived):
            if f.name not in self.used:
                raise self.error(f"flag '{f.name}' is never used", f.loc, hint="remove it or use it")

    def check_nonneg(self, combo: Combo, qualify: bool) -> None:
        """Every `nonneg` state starts and stays >= 0, by interval analysis (see `_Bounds`)."""
        flags = dict(combo)
        why = f" (when {describe_combo(combo)})" if qualify and combo else ""
        bounds = _Bounds(self.spec, flags)
        present = {s.name for s in states_present(self.spec, flags)}
        nonneg = {s.name: s for s in self.spec.states if s.nonneg and s.name in present}
        for s in nonneg.values():
            low, _ = bounds.of(s.init)
            if low < 0:
                raise self.error(
                    f"state '{s.name}' is declared nonneg but its initial value can be negative",
                    s.init.loc, hint="remove 'nonneg' or start it at a value >= 0",
                )
        for stmt in specialize(self.spec.body, flags):
            low, high = bounds.of(stmt.value)
            if stmt.target in nonneg and low < 0:
                raise self.error(
                    f"state '{stmt.target}' is declared nonneg, but this value can be negative{why}"
                    f" (its lower bound is {ir.format_number(low)})",
                    stmt.value.loc,
                    hint="int8 storage of a nonneg state uses an unsigned map that clamps at 0; remove 'nonneg' "
                    "or narrow the ranges of the hyperparameters this value uses",
                )
            bounds.assign(stmt.target, (max(low, 0.0), high) if stmt.target in nonneg else (low, high))

    def run(self) -> None:
        self.check_declarations()
        self.check_body_structure()
        combos = combinations(self.spec)
        # First find whether a problem is independent of the flags (then say it plainly).
        errors = []
        for combo in combos:
            try:
                self.check_combination(combo, qualify=False)
            except SpecError as err:
                errors.append((combo, err))
        if errors:
            if len(errors) == len(combos):
                raise errors[0][1]
            self.check_combination(errors[0][0], qualify=True)
        self.check_unused()
        failing = []
        for combo in combos:
            try:
                self.check_nonneg(combo, qualify=False)
            except SpecError:
                failing.append(combo)
        if failing:
            self.check_nonneg(failing[0], qualify=len(failing) < len(combos))


_INF = math.inf


def _mul_iv(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    products = []
    for x in a:
        for y in b:
            products.append(0.0 if x == 0 or y == 0 else x * y)  # 0 * inf counts as 0 (a bound, not a value)
    return min(products), max(products)


class _Bounds:
    """Interval analysis of a specialized update: [low, high] for every value.

    Hyperparameters take their declared ranges, `step` is >= 1, nonneg states
    are >= 0, everything else per-element is unbounded.  A product is split
    into its factors so that `c * g * g` is seen as `c * g²` (g² >= 0).
    """

    def __init__(self, spec: ir.Spec, flags: dict[str, bool]) -> None:
        self.flags = flags
        self.env: dict[str, tuple[float, float]] = {"step": (1.0, _INF)}
        for h in spec.hypers:
            self.env[h.name] = (h.interval.low, h.interval.high)
        for s in spec.states:
            self.env[s.name] = (0.0, _INF) if s.nonneg else (-_INF, _INF)
        for s in spec.scalars:
            self.env[s.name] = (-_INF, _INF)
        self.env["param"] = self.env["grad"] = (-_INF, _INF)

    def assign(self, name: str, iv: tuple[float, float]) -> None:
        self.env[name] = iv

    def of(self, e: ir.Expr) -> tuple[float, float]:
        if isinstance(e, ir.Num):
            return e.value, e.value
        if isinstance(e, ir.BoolLit):
            return 0.0, 1.0
        if isinstance(e, ir.Name):
            return self.env.get(e.id, (-_INF, _INF))
        if isinstance(e, ir.Unary):
            lo, hi = self.of(e.operand)
            return (-hi, -lo) if e.op == "neg" else (0.0, 1.0)
        if isinstance(e, ir.Binary):
            if e.op == "mul":
                return self._product(e)
            a, b = self.of(e.left), self.of(e.right)
            if e.op == "add":
                return a[0] + b[0], a[1] + b[1]
            if e.op == "sub":
                return a[0] - b[1], a[1] - b[0]
            if e.op == "div":
                if b[0] > 0:
                    return _mul_iv(a, (1.0 / b[1] if b[1] < _INF else 0.0, 1.0 / b[0]))
                if a[0] >= 0 and b[0] >= 0:
                    return 0.0, _INF
                return -_INF, _INF
            if e.op == "pow":
                return (0.0, _INF) if a[0] >= 0 else (-_INF, _INF)
            return 0.0, 1.0  # comparisons and logic
        if isinstance(e, ir.Call):
            args = [self.of(x) for x in e.args]
            f = e.func
            if f in ("sqrt", "rsqrt", "exp"):
                return 0.0, _INF
            if f == "abs":
                lo, hi = args[0]
                return (max(0.0, lo, -hi) if lo > 0 or hi < 0 else 0.0), max(abs(lo), abs(hi))
            if f == "sign":
                return -1.0, 1.0
            if f == "min":
                return min(args[0][0], args[1][0]), min(args[0][1], args[1][1])
            if f == "max":
                return max(args[0][0], args[1][0]), max(args[0][1], args[1][1])
            if f == "clamp":  # min(max(x, lo), hi), also when lo > hi (then every value is hi)
                (x_lo, x_hi), (lo_lo, lo_hi), (hi_lo, hi_hi) = args
                return min(max(x_lo, lo_lo), hi_lo), min(max(x_hi, lo_hi), hi_hi)
            if f == "where":
                cond = e.args[0]
                try:
                    taken = eval_static(cond, self.flags)
                except (AssertionError, KeyError):
                    taken = None
                if taken is True:
                    return args[1]
                if taken is False:
                    return args[2]
                return min(args[1][0], args[2][0]), max(args[1][1], args[2][1])
            return -_INF, _INF  # log
        return -_INF, _INF

    def _product(self, e: ir.Expr) -> tuple[float, float]:
        factors: list[ir.Expr] = []

        def collect(x: ir.Expr) -> None:
            if isinstance(x, ir.Binary) and x.op == "mul":
                collect(x.left)
                collect(x.right)
            else:
                factors.append(x)

        collect(e)
        result = (1.0, 1.0)
        remaining = list(factors)
        while remaining:
            f = remaining.pop(0)
            twin = next((i for i, g in enumerate(remaining) if g == f), None)
            if twin is not None:  # f * f >= 0
                remaining.pop(twin)
                lo, hi = self.of(f)
                square_hi = max(lo * lo, hi * hi)
                square_lo = 0.0 if lo <= 0 <= hi else min(lo * lo, hi * hi)
                result = _mul_iv(result, (square_lo, square_hi))
            else:
                result = _mul_iv(result, self.of(f))
        return result


def _iter_names(expr: ir.Expr) -> Iterator[ir.Name]:
    if isinstance(expr, ir.Name):
        yield expr
    elif isinstance(expr, ir.Unary):
        yield from _iter_names(expr.operand)
    elif isinstance(expr, ir.Binary):
        yield from _iter_names(expr.left)
        yield from _iter_names(expr.right)
    elif isinstance(expr, ir.Call):
        for a in expr.args:
            yield from _iter_names(a)


def check_spec(spec: ir.Spec) -> ir.Spec:
    """Raise `SpecError` for the first problem in `spec`; return it unchanged when it is valid."""
    try:
        _Checker(spec).run()
    except RecursionError:
        raise SpecError("the spec is nested too deeply to check", spec.loc, spec.source,
                        hint="split long expressions with temporaries") from None
    return spec
