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
    they are read, and `param` and every state are updated;
  * `nonneg` states stay >= 0 (the interval proof of `nonneg.check_nonneg`).

Flags select code at compile time, so the body is checked once per
combination of flag values (`variants.combinations`), after
`variants.specialize` has resolved each `if`.  The lowering stage reuses both.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Optional

from . import ir
from .errors import Loc, SpecError, did_you_mean
from .names import (API_KEYWORDS, BARRIER_FUNCTIONS, BUILTIN_FUNCTIONS, BUILTIN_VALUES, COLLIDING_NAMES,
                    NOT_ELEMENT_WISE_HINT, PER_TENSOR_FUNCTIONS, REDUCTIONS, RESERVED_NAMES, SCHEDULER_KEYS,
                    SHAPE_VALUES)
from .nonneg import check_nonneg
from .printer import print_expr
from .scalar_ops import fp32
from .placement import check_barrier_placement
from .variants import (Combo, combinations, describe_combo, iter_names, names_read, specialize, states_present,
                       walk_statements)

__all__ = ["API_KEYWORDS", "BUILTIN_FUNCTIONS", "BUILTIN_VALUES", "Level", "MAX_FLAGS", "RESERVED_NAMES", "Type",
           "check_spec"]

MAX_FLAGS = 8

# How messages name a symbol of each kind ("'grad' is the gradient; ...").
_KIND_PHRASES = {
    "param": "the parameter (a per-element value)",
    "grad": "the gradient (a per-element value)",
    "step": "the step counter",
    "shape": "the weight's shape (one value per tensor)",
    "state": "a state",
    "scalar state": "a scalar state",
    "tuple keyword": "a tuple keyword",
}


_KEYWORD_KINDS = ("hyperparameter", "flag", "derived flag", "choice")  # what a derived flag or a 'require' reads


class Type(enum.Enum):
    REAL = "number"
    BOOL = "boolean"
    WORD = "word"  # a choice keyword's value, or a quoted word


class Level(enum.IntEnum):
    """How often a value changes: the lowering hoists everything below ELEMENT."""

    CONST = 0  # a literal
    FLAG = 1  # fixed when the kernel is compiled
    HOST = 2  # once per step per tensor (hyperparameters, step, scalar state)
    ELEMENT = 3  # per element (param, grad, state)


# ----------------------------------------------------------------------------
# The checker
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Symbol:
    kind: str  # hyper, group, flag, derived, state, scalar, param, grad, step, temp
    type: Type
    level: Level


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
        self.optional: set[str] = set()  # hyperparameters declared '= none'
        self.allow_given = False  # given(...) is allowed in derived flags and 'require' only
        self.temps_anywhere = {
            s.target
            for s in walk_statements(spec.body)
            if isinstance(s, ir.Assign)
        }

    def error(self, message: str, loc: Loc, hint: Optional[str] = None) -> SpecError:
        return SpecError(message, loc, self.spec.source, hint)

    # -- declarations ------------------------------------------------------
    def declare(self, name: str, symbol: _Symbol, loc: Loc) -> None:
        if name in BUILTIN_VALUES or name in SHAPE_VALUES:
            raise self.error(f"'{name}' is built in and cannot be declared", loc)
        if name in BUILTIN_FUNCTIONS:
            raise self.error(f"'{name}' is a built-in function and cannot be declared", loc)
        self.check_name(name, loc)
        if name in self.symbols:
            raise self.error(f"duplicate name '{name}': it is already declared as a {self.symbols[name].kind}", loc)
        self.symbols[name] = symbol

    def check_name(self, name: str, loc: Loc) -> None:
        if name in COLLIDING_NAMES:
            raise self.error(
                f"'{name}' is reserved (it would collide with Python, Triton or generated code); choose another name",
                loc,
            )
        if name in API_KEYWORDS:
            raise self.error(
                f"'{name}' is reserved: it is a keyword of forge_dsl's Python API (kernels.step, "
                "ForgeOptimizer, ...), which would take it instead of the spec's keyword; choose another name",
                loc,
            )
        if name in SCHEDULER_KEYS:
            raise self.error(f"'{name}' is reserved: torch's learning-rate schedulers (or SWA) write it into every "
                             "param group, which would replace the spec's value; choose another name", loc)
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
            **{name: _Symbol("shape", Type.REAL, Level.HOST) for name in SHAPE_VALUES},
        }
        self.check_name(spec.name, spec.loc)
        members = {m for g in spec.groups for m in g.members}
        groups = iter(spec.groups)
        # In source order, so that a duplicate is reported where it is written
        # a second time (a tuple keyword is declared just before its members,
        # which follow it in `spec.hypers`, the first with index 0).
        for h in spec.hypers:
            if h.group is not None and h.index == 0:
                g = next(groups)
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
            if h.default is not None:
                self.check_fp32_default(h)
        for f in spec.flags:
            self.declare(f.name, _Symbol("flag", Type.BOOL, Level.FLAG), f.loc)
        for c in spec.choices:
            self.declare(c.name, _Symbol("choice", Type.WORD, Level.HOST), c.loc)
        self.optional = {h.name for h in spec.hypers if h.optional}
        for d in spec.derived:
            t, level = self.infer_declaration_expr(
                d.expr, allowed=_KEYWORD_KINDS, what=f"flag '{d.name}'"
            )
            if t is not Type.BOOL:
                raise self.error(
                    f"flag '{d.name}' must be true, false or a condition on hyperparameters, not a {t.value}",
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
            self.check_initial_value(s.init, s.name, scalar=True)
        for r in spec.requires:
            t, _ = self.infer_declaration_expr(
                r.condition, allowed=_KEYWORD_KINDS, what="a 'require' condition"
            )
            if t is not Type.BOOL:
                raise self.error("a 'require' condition must be a boolean", r.condition.loc,
                                 hint="compare it, e.g. 'x > 0'")
        # Kinds are fixed now; rename the member symbols' kind for messages.
        for m in members:
            self.symbols[m] = _Symbol("hyperparameter", Type.REAL, Level.HOST)

    def check_fp32_default(self, h: ir.Hyper) -> None:
        """The kernels read a hyperparameter rounded to fp32 (docs/LANGUAGE.md, section 6): its default's fp32
        value must lie in its range too, the range's ends rounded alike (so `0.1 in [0, 0.1]` holds)."""
        iv, value = h.interval, fp32(h.default)
        if ir.Interval(fp32(iv.low), fp32(iv.high), iv.low_closed, iv.high_closed).contains(value):
            return
        shown = "-0" if value == 0 and math.copysign(1.0, value) < 0 else ir.format_number(value)
        raise self.error(
            f"the default {ir.format_number(h.default)} of '{h.name}' is {shown} in fp32, outside its range {iv}",
            h.default_loc if h.default_loc is not ir.NO_LOC else h.loc,
            hint="the kernels read each hyperparameter rounded to fp32 (docs/LANGUAGE.md, section 6); choose a "
            "default that fp32 holds inside the range",
        )

    def check_interval(self, iv: ir.Interval, name: str, loc: Loc) -> None:
        if iv.low > iv.high or (iv.low == iv.high and not (iv.low_closed and iv.high_closed)):
            raise self.error(f"the range {iv} of '{name}' is empty", loc)

    def check_initial_value(self, init: ir.Expr, name: str, scalar: bool = False) -> None:
        _, base = ir.initial_parts(init)
        if isinstance(base, (ir.Num, ir.Name)):
            init = base
        if isinstance(init, ir.Num):
            return
        if isinstance(init, ir.Name) and init.id == "param":
            if scalar:
                raise self.error(
                    f"scalar state '{name}' is one number per tensor, so it cannot start from 'param'", init.loc,
                    hint="a per-element state can: 'state NAME = param'",
                )
            return
        if isinstance(init, ir.Name) and self.symbols.get(init.id, _Symbol("", Type.REAL, Level.CONST)).kind == "hyperparameter":
            if init.id in self.optional:
                raise self.error(
                    f"the initial value of '{name}' cannot be the optional hyperparameter '{init.id}': it may be none",
                    init.loc,
                )
            self.used.add(init.id)
            return
        if isinstance(init, ir.Name) and init.id not in self.symbols and init.id not in BUILTIN_FUNCTIONS:
            raise self.error(
                f"unknown name '{init.id}' in the initial value of '{name}'"
                + did_you_mean(init.id, [h.name for h in self.spec.hypers]),
                init.loc,
            )
        what = "a number or a hyperparameter" if scalar else "a number, a hyperparameter or 'param'"
        raise self.error(f"the initial value of '{name}' must be {what}", init.loc)

    def infer_declaration_expr(self, expr: ir.Expr, allowed: tuple[str, ...], what: str) -> tuple[Type, Level]:
        """Type a derived flag or a 'require' (`what`, for messages): keywords only."""
        declared_later = {s.name: "a state" for s in self.spec.states}
        declared_later.update({s.name: "a scalar state" for s in self.spec.scalars})
        declared_later.update({d.name: "a flag" for d in self.spec.derived})
        for n in iter_names(expr):
            sym = self.symbols.get(n.id)
            if n.id in self.optional:
                raise self.error(
                    f"'{n.id}' is an optional hyperparameter and may be none; {what} may test only given({n.id})",
                    n.loc,
                    hint=f"read its value in the update, under a flag such as 'flag has_{n.id} = given({n.id})'",
                )
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
        self.allow_given = True
        try:
            return self.infer(expr, env=set(), defined_somewhere=set())
        finally:
            self.allow_given = False

    def check_compile_time_condition(self, cond: ir.Expr, what: str) -> None:
        for n in iter_names(cond):
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
        if isinstance(expr, ir.Method):
            return self.refuse_method(expr)
        if isinstance(expr, ir.Given):
            return self.infer_given(expr)
        if isinstance(expr, ir.Text):
            if not self.allow_given:
                raise self.error(f'the word "{expr.value}" may only be compared with a choice keyword, in a derived '
                                 "flag or a 'require'", expr.loc)
            return Type.WORD, Level.CONST
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
            if Type.WORD in (lt, rt):
                return self.infer_choice_test(expr, lt, rt)
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

    def infer_choice_test(self, expr: ir.Binary, lt: Type, rt: Type) -> tuple[Type, Level]:
        """`choice == "word"` (or `!=`, either way round): a boolean, when the word is one of the choice's."""
        names = [e for e in (expr.left, expr.right) if isinstance(e, ir.Name)]
        words = [e for e in (expr.left, expr.right) if isinstance(e, ir.Text)]
        if expr.op not in ("eq", "ne") or len(names) != 1 or len(words) != 1:
            raise self.error("a choice keyword is read only as 'NAME == \"word\"' or 'NAME != \"word\"'", expr.loc)
        choice = next((c for c in self.spec.choices if c.name == names[0].id), None)
        if choice is None:
            raise self.error(f"'{names[0].id}' is not a choice keyword: only a choice is compared with a word like "
                             f'"{words[0].value}"', expr.loc)
        if words[0].value not in choice.values:
            raise self.error(f'"{words[0].value}" is not a word of \'{choice.name}\''
                             + did_you_mean(words[0].value, choice.values), words[0].loc,
                             hint="its words are " + ", ".join(f'"{w}"' for w in choice.values))
        return Type.BOOL, Level.HOST

    def refuse_method(self, expr: ir.Method):
        name = expr.method
        if name in BARRIER_FUNCTIONS:
            raise self.error(f"'.{name}()' is a method call; {name}() of the whole weight is written as a statement "
                             f"of its own, 'r = {name}(x)' (docs/LANGUAGE.md section 9.1)", expr.loc)
        if name in REDUCTIONS:
            raise self.error(
                f"'.{name}()' is a reduction, and reductions are not element-wise: an element's update may read "
                "only its own param, grad and state",
                expr.loc,
                hint=NOT_ELEMENT_WISE_HINT,
            )
        if name in BUILTIN_FUNCTIONS:
            raise self.error(
                f"'.{name}()' is a method call; the built-in function is called as {name}(...)", expr.loc
            )
        raise self.error(
            f"'.{name}()' is not allowed: an element's update may read only its own param, grad and state, "
            "through the built-in functions",
            expr.loc,
        )

    def infer_given(self, expr: ir.Given) -> tuple[Type, Level]:
        if not self.allow_given:
            raise self.error(
                "given() may be used only in a derived flag or a 'require'",
                expr.loc,
                hint=f"declare 'flag has_{expr.name} = given({expr.name})' and test the flag with 'if'",
            )
        if expr.name not in self.optional:
            if expr.name not in self.symbols:
                raise self.error(f"unknown name '{expr.name}' in given()" + did_you_mean(expr.name, self.optional),
                                 expr.loc)
            raise self.error(
                f"given() tests an optional hyperparameter (declared '= none'); '{expr.name}' is not one: "
                "it always has a value",
                expr.loc,
            )
        self.used.add(expr.name)
        return Type.BOOL, Level.HOST

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
        if sym.kind == "choice" and not self.allow_given:
            word = next(c for c in self.spec.choices if c.name == name).values[-1]
            raise self.error(f"choice '{name}' is read only by a derived flag or a 'require'", expr.loc,
                             hint=f"declare 'flag f = {name} == \"{word}\"' and test the flag with 'if'")
        self.used.add(name)
        return sym.type, sym.level

    def infer_call(self, expr: ir.Call, env, defined_somewhere, why) -> tuple[Type, Level]:
        func = expr.func
        if func in BARRIER_FUNCTIONS:
            return self.infer_barrier(expr, env, defined_somewhere, why)
        if func not in BUILTIN_FUNCTIONS:
            if func in REDUCTIONS:
                raise self.error(
                    f"'{func}' combines several elements and is not element-wise; "
                    "an element's update may read only its own param, grad and state",
                    expr.func_loc,
                    hint=NOT_ELEMENT_WISE_HINT,
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
        if func in ir.ELEMENT_FUNCTIONS and self.allow_given:  # allow_given: in a derived flag or a 'require'
            raise self.error(f"{func}() is per element (it rounds as each weight is stored); a derived flag or a "
                             "'require' may use only hyperparameters and flags", expr.func_loc)
        return Type.REAL, Level.ELEMENT if func in ir.ELEMENT_FUNCTIONS else level

    def infer_barrier(self, expr: ir.Call, env, defined_somewhere, why) -> tuple[Type, Level]:
        """orthogonalize(x, steps, a, b, c, eps), a matrix per element; norm(x), sum(x), mean(x), one value per
        tensor: x a per-element name, the rest one value per tensor. Where they may stand is `placement`'s."""
        func = expr.func
        if self.allow_given:
            raise self.error(f"{func}() reads the whole weight; a derived flag or a 'require' may use only "
                             "hyperparameters and flags", expr.func_loc)
        arity = BARRIER_FUNCTIONS[func]
        if len(expr.args) != arity:
            what = ("x, steps, a, b, c, eps: torch.optim.Muon's ns_steps, ns_coefficients and eps" if arity > 1
                    else "a per-element value, reduced over the whole tensor")
            raise self.error(f"{func}() takes {arity} argument{'s' if arity > 1 else ''} ({what}), got "
                             f"{len(expr.args)}", expr.loc)
        first = expr.args[0]
        t, level = self.infer(first, env, defined_somewhere, why)
        self.expect_real(first, t, f"{func}()")
        if not isinstance(first, ir.Name) or level < Level.ELEMENT:
            raise self.error(f"the first argument of {func}() must name a value per element, row or column (param, "
                             "a state or a temporary), not " + ("one per tensor" if isinstance(first, ir.Name) else
                                                                "an expression"), first.loc, hint=f"assign it to a temporary first: 'u = ...' then "
                             f"'{func}(u{', ...' if arity > 1 else ''})'")
        for arg in expr.args[1:]:
            t, level = self.infer(arg, env, defined_somewhere, why)
            self.expect_real(arg, t, f"{func}()")
            if level > Level.HOST:
                raise self.error(f"{func}()'s steps, coefficients and eps are one value per tensor; this one differs "
                                 "per element", arg.loc)
        return Type.REAL, Level.HOST if func in PER_TENSOR_FUNCTIONS else Level.ELEMENT

    def expect_real(self, expr: ir.Expr, t: Type, where: str) -> None:
        if t is Type.REAL:
            return
        if isinstance(expr, ir.Name) and self.symbols.get(expr.id, _Symbol("", t, Level.CONST)).kind in ("flag", "derived flag"):
            raise self.error(
                f"flag '{expr.id}' is a boolean and cannot be used as a number in {where}",
                expr.loc,
                hint=f"choose between two values with where({expr.id}, a, b)",
            )
        raise self.error(f"{_describe(expr)} is a {t.value}; {where} needs a number", expr.loc)

    def expect_bool(self, expr: ir.Expr, t: Type, where: str) -> None:
        if t is Type.BOOL:
            return
        raise self.error(
            f"{_describe(expr)} is a {t.value}; {where} needs a boolean",
            expr.loc,
            hint="compare it, e.g. 'x > 0'",
        )

    # -- the body ----------------------------------------------------------
    def check_body_structure(self) -> None:
        """Checks that do not depend on flag values: targets, if-conditions, expression types."""
        for stmt in walk_statements(self.spec.body):
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
            for n in names_read(stmt.value, flags):
                if n.id in self.optional and n.id not in env and not self.given_in(n.id, flags):
                    raise self.error(
                        f"hyperparameter '{n.id}' may be none here{why}: the update may read it only where a "
                        f"flag that tests given({n.id}) is true",
                        n.loc,
                        hint=self.given_hint(n.id),
                    )
            for n in iter_names(stmt.value):
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

    def given_hint(self, name: str) -> str:
        guard = next((d.name for d in self.spec.derived if _implies_given(d.expr, name)), None)
        if guard is None:
            return f"declare 'flag has_{name} = given({name})' and read it inside 'if has_{name} {{ ... }}'"
        return f"read it only inside 'if {guard} {{ ... }}' (or where({guard}, ..., ...))"

    def given_in(self, name: str, flags: dict[str, bool]) -> bool:
        """Whether a derived flag that is true in `flags` implies given(name)."""
        return any(flags.get(d.name) and _implies_given(d.expr, name) for d in self.spec.derived)

    def absent_state_message(self, name: str, why: str) -> str:
        state = next(s for s in self.spec.states if s.name == name)
        return f"state '{name}' does not exist here{why}: it is declared only if {print_expr(state.condition)}"

    def check_unused(self) -> None:
        for h in self.spec.hypers:
            if h.name not in self.used:
                raise self.error(f"hyperparameter '{h.name}' is never used", h.loc, hint="remove it or use it")
        for f in list(self.spec.flags) + list(self.spec.derived) + list(self.spec.choices):
            if f.name not in self.used:
                kind = "choice" if isinstance(f, ir.Choice) else "flag"
                raise self.error(f"{kind} '{f.name}' is never used", f.loc, hint="remove it or use it")

    def run(self) -> None:
        self.check_declarations()
        self.check_body_structure()
        check_barrier_placement(self.spec, {name: sym.kind for name, sym in self.symbols.items()})
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
                check_nonneg(self.spec, combo, qualify=False)
            except SpecError:
                failing.append(combo)
        if failing:
            check_nonneg(self.spec, failing[0], qualify=len(failing) < len(combos))


def _implies_given(expr: ir.Expr, name: str) -> bool:
    """Whether `expr` can be true only when given(name) is: given(name), or a conjunction with it."""
    if isinstance(expr, ir.Given):
        return expr.name == name
    if isinstance(expr, ir.Binary) and expr.op == "and":
        return _implies_given(expr.left, name) or _implies_given(expr.right, name)
    return False


def check_spec(spec: ir.Spec) -> ir.Spec:
    """Raise `SpecError` for the first problem in `spec`; return it unchanged when it is valid."""
    try:
        _Checker(spec).run()
    except RecursionError:
        raise SpecError("the spec is nested too deeply to check", spec.loc, spec.source,
                        hint="split long expressions with temporaries") from None
    return spec
