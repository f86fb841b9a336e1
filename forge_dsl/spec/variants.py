"""Flag combinations and compiled variants of a spec, and the walks every later stage shares.

Flags select code when a kernel is compiled: the body is checked (`checker`) and lowered (`lowering`)
once per combination of flag values (`combinations`), after `specialize` has resolved each `if`. A flag
read only inside the update's expressions is a runtime flag (`runtime_flags`): both of its values run
one compiled variant (`variants`, `variant_of`).

One home for each of these decisions: `evaluate` is the one evaluator of compile-time and host
expressions (flags, derived flags, `require`s, a where() on flags), `walk_statements` the one walk of a
body's statements, `states_present` the one answer to which states exist for given flag values.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterator, Mapping

from . import ir
from .scalar_ops import apply_scalar_op

__all__ = ["Combo", "combinations", "runtime_flags", "variants", "variant_of", "describe_combo", "evaluate",
           "eval_static", "specialize", "states_present", "walk_statements", "assignments", "children",
           "iter_calls", "iter_names", "names_read", "walk"]

Combo = tuple[tuple[str, bool], ...]


def combinations(spec: ir.Spec) -> list[Combo]:
    """Every assignment of True/False to the flags and derived flags, in declaration order."""
    names = [f.name for f in spec.flags] + [d.name for d in spec.derived]
    return [tuple(zip(names, values)) for values in itertools.product((False, True), repeat=len(names))]


def runtime_flags(spec: ir.Spec) -> frozenset[str]:
    """The flags that need no compiled variant of their own: read only inside the update's expressions
    (`where(maximize, -grad, grad)`), never by an `if`, a state's condition or a derived flag.  The kernels
    take them as host values, so both of their values run one compiled variant, as torch.optim's
    `maximize` is a runtime branch.  In a spec with optional hyperparameters every flag stays compile-time:
    there a where() on a flag may guard a read of a hyperparameter that is none, and a runtime select
    evaluates both of its branches."""
    if any(h.optional for h in spec.hypers):
        return frozenset()
    compile_time: set[str] = set()
    conditions = [s.condition for s in walk_statements(spec.body) if isinstance(s, ir.If)]
    conditions += [s.condition for s in spec.states if s.condition is not None]
    conditions += [d.expr for d in spec.derived]
    for cond in conditions:
        compile_time.update(n.id for n in iter_names(cond))
    return frozenset(f.name for f in spec.flags if f.name not in compile_time)


def variants(spec: ir.Spec) -> list[Combo]:
    """The compiled variants: every assignment of the flags that are not `runtime_flags`, in
    `combinations` order (what `variant_of` maps a combination to)."""
    runtime = runtime_flags(spec)
    names = [f.name for f in spec.flags if f.name not in runtime] + [d.name for d in spec.derived]
    return [tuple(zip(names, values)) for values in itertools.product((False, True), repeat=len(names))]


def variant_of(spec: ir.Spec, combo: Combo) -> Combo:
    """The compiled variant that runs the flag combination `combo`: `combo` without the runtime flags."""
    runtime = runtime_flags(spec)
    return tuple((name, value) for name, value in combo if name not in runtime)


def describe_combo(combo: Combo) -> str:
    return ", ".join(f"{name}={'true' if value else 'false'}" for name, value in combo)


def evaluate(expr: ir.Expr, values: Mapping[str, Any]):
    """The value of an expression over named values (Python floats and bools): flags for a compile-time
    condition; hyperparameters, flags and choices (words, or None) for a derived flag or a `require`
    (`given(h)`: whether `values[h]` is not None).

    Raises:
        KeyError: a name without a value.
        AssertionError: an expression no declaration can hold (indexing, a method call).
    """
    if isinstance(expr, (ir.Num, ir.BoolLit, ir.Text)):
        return expr.value
    if isinstance(expr, ir.Given):
        return values[expr.name] is not None
    if isinstance(expr, ir.Name):
        return values[expr.id]
    if isinstance(expr, ir.Unary):
        return apply_scalar_op(expr.op, evaluate(expr.operand, values))
    if isinstance(expr, ir.Binary):
        return apply_scalar_op(expr.op, evaluate(expr.left, values), evaluate(expr.right, values))
    if isinstance(expr, ir.Call):
        return apply_scalar_op(expr.func, *(evaluate(a, values) for a in expr.args))
    raise AssertionError(f"not a compile-time or host expression: {expr!r}")


def eval_static(expr: ir.Expr, flags: Mapping[str, bool]) -> bool:
    """A compile-time condition's truth: flags and literals, combined by any operator or function."""
    return bool(evaluate(expr, flags))


def specialize(body: tuple[ir.Stmt, ...], flags: Mapping[str, bool]) -> list[ir.Assign]:
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


def states_present(spec: ir.Spec, flags: Mapping[str, bool]) -> tuple[ir.State, ...]:
    """The states that exist when the flags have these values, in declaration order."""
    return tuple(s for s in spec.states if s.condition is None or eval_static(s.condition, flags))


def walk_statements(body) -> Iterator[ir.Stmt]:
    """Every statement of a body, each `if` before the statements of both its branches, in source order."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, ir.If):
            yield from walk_statements(stmt.then)
            yield from walk_statements(stmt.orelse)


def assignments(body) -> Iterator[ir.Assign]:
    """Every assignment of a body, in every branch, in source order."""
    return (s for s in walk_statements(body) if isinstance(s, ir.Assign))


def children(expr: ir.Expr) -> tuple[ir.Expr, ...]:
    """The expressions `expr` is made of, left to right."""
    if isinstance(expr, ir.Unary):
        return (expr.operand,)
    if isinstance(expr, ir.Binary):
        return (expr.left, expr.right)
    if isinstance(expr, ir.Call):
        return expr.args
    if isinstance(expr, ir.Index):
        return (expr.base,) + expr.indices
    if isinstance(expr, ir.Attribute):
        return (expr.base,)
    if isinstance(expr, ir.Method):
        return (expr.base,) + expr.args
    return ()


def walk(expr: ir.Expr) -> Iterator[ir.Expr]:
    """`expr` and every expression it is made of, outermost first, left to right."""
    stack = [expr]
    while stack:
        e = stack.pop()
        yield e
        stack.extend(reversed(children(e)))


def iter_names(expr: ir.Expr) -> Iterator[ir.Name]:
    """Every name `expr` reads, left to right."""
    return (e for e in walk(expr) if isinstance(e, ir.Name))


def iter_calls(expr: ir.Expr) -> Iterator[ir.Call]:
    """Every call in `expr`, outermost first."""
    return (e for e in walk(expr) if isinstance(e, ir.Call))


def names_read(expr: ir.Expr, flags: dict[str, bool]) -> Iterator[ir.Name]:
    """The names `expr` reads when the flags have these values: a where() on flags reads one branch."""
    stack = [expr]
    while stack:
        e = stack.pop()
        if isinstance(e, ir.Name):
            yield e
        elif isinstance(e, ir.Call) and e.func == "where" and len(e.args) == 3:
            try:
                taken = eval_static(e.args[0], flags)
            except (AssertionError, KeyError, TypeError, ValueError):
                stack.extend(reversed(e.args))
            else:
                stack.append(e.args[1] if taken else e.args[2])
        else:
            stack.extend(reversed(children(e)))
