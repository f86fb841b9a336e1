"""Where the functions of the whole weight (`names.BARRIER_FUNCTIONS`: `orthogonalize`, `norm`, `rowmean`, ...) and
the values per row or per column may stand in an update: the checker's rule, kept beside it so that `phases` splits
the update where this module says without checking again.

Every value of an update has an **extent**: how many numbers it is per weight.

    host      one number per tensor, known before the step's gradient (keywords, `step`, the weight's shape)
    tensor    one number per tensor computed from the weight (`norm`, `sum`, `mean`, and arithmetic on them)
    rows      one number per row of the weight seen as a matrix (`rowmean`, a state declared `[rows]`)
    cols      one number per column (`colmean`, a state declared `[cols]`)
    element   one number per weight element (`param`, `grad`, per-element states)

Arithmetic broadcasts: a value per row with one per column is per element. The **region** is the span of the
update's top-level statements from the first that calls a function of the whole weight to the last that calls
one or reads or writes a value per row or column; it runs on the whole weight of one layer, after the tile phase
(the statements before it) and before the post phase (those after it, which write the weight).
"""

from __future__ import annotations

from typing import Mapping, Optional

from . import ir
from .errors import SpecError
from .names import BARRIER_FUNCTIONS, PER_TENSOR_FUNCTIONS, ROW_COLUMN_FUNCTIONS
from .variants import iter_calls, iter_names, walk_statements

__all__ = ["check_barrier_placement", "extents", "region_bounds"]

_EXTENTS = ("host", "tensor", "rows", "cols", "element")  # narrowest first
_UNITS = {"host": "tensor", "tensor": "tensor", "rows": "row", "cols": "column", "element": "element"}


def _join(a: str, b: str) -> str:
    """The extent of a value made of values of extents a and b (broadcasting)."""
    if {a, b} == {"rows", "cols"}:
        return "element"
    return max(a, b, key=_EXTENTS.index)


def _declared(spec: ir.Spec) -> dict[str, str]:
    out = {"param": "element", "grad": "element"}
    out.update({s.name: s.extent or "element" for s in spec.states})
    return out


def _extent(expr: ir.Expr, env: Mapping[str, str]) -> str:
    if isinstance(expr, ir.Call) and expr.func in BARRIER_FUNCTIONS:
        if expr.func in PER_TENSOR_FUNCTIONS:
            return "tensor"
        if expr.func in ROW_COLUMN_FUNCTIONS:
            return ROW_COLUMN_FUNCTIONS[expr.func]
        return "element"
    out = "host"
    for name in iter_names(expr):
        out = _join(out, env.get(name.id, "host"))
    return out


def extents(spec: ir.Spec) -> dict[str, str]:
    """The extent of every value the update assigns or reads by name (a temporary assigned in several places:
    the widest), and of `param`, `grad` and the states."""
    declared = _declared(spec)
    env = dict(declared)
    for stmt in walk_statements(spec.body):
        if isinstance(stmt, ir.Assign) and stmt.target not in declared:
            env[stmt.target] = _join(env.get(stmt.target, "host"), _extent(stmt.value, env))
    return env


def _touches_whole_weight(stmt: ir.Stmt, env: Mapping[str, str]) -> bool:
    for s in walk_statements((stmt,)):
        e = s.condition if isinstance(s, ir.If) else s.value
        if any(c.func in BARRIER_FUNCTIONS for c in iter_calls(e)):
            return True
        names = [n.id for n in iter_names(e)] + ([s.target] if isinstance(s, ir.Assign) else [])
        if any(env.get(n) in ("rows", "cols") for n in names):
            return True
    return False


def region_bounds(spec: ir.Spec) -> Optional[tuple[int, int]]:
    """(first, last + 1): the region's top-level statements, `spec.body[first:last + 1]`; None without one."""
    env = extents(spec)
    marked = [i for i, stmt in enumerate(spec.body) if _touches_whole_weight(stmt, env)]
    return (marked[0], marked[-1] + 1) if marked else None


def check_barrier_placement(spec: ir.Spec, kinds: Mapping[str, str]) -> None:
    """Functions of the whole weight are each the whole value of a statement of its own that assigns a temporary
    nothing else assigns, at most one of them a matrix (`orthogonalize`); values per row or per column reach only
    what the region computes; `param` is assigned after the region only (the weight is written once, by the last
    phase), no per-element state inside it (it runs in fp32 on the whole weight, where a state's layout would have
    to be rounded); no scalar state. `kinds`: each declared or built-in name -> its kind, for messages.

    Raises:
        SpecError: located at the call or statement that breaks the rule.
    """
    def error(message: str, loc, hint=None) -> SpecError:
        return SpecError(message, loc, spec.source, hint)

    env = extents(spec)
    calls: list[tuple[ir.Assign, ir.Call]] = []
    for stmt in walk_statements(spec.body):
        e = stmt.condition if isinstance(stmt, ir.If) else stmt.value
        for call in iter_calls(e):
            if call.func not in BARRIER_FUNCTIONS:
                continue
            if call is not e or isinstance(stmt, ir.If):
                raise error(f"{call.func}() reads the whole weight, so it must be the whole value of a statement of "
                            "its own", call.loc, hint=f"write 'r = {call.func}(...)' and use 'r' after it")
            calls.append((stmt, call))
    _check_extents(spec, env, error)
    bounds = region_bounds(spec)
    if bounds is None:
        return
    matrices = [c for _, c in calls if c.func == "orthogonalize"]
    if len(matrices) > 1:
        raise error("only one orthogonalize() per update is supported; this is the second", matrices[1].loc)
    for call in matrices:
        source = call.args[0]
        if isinstance(source, ir.Name) and env.get(source.id) != "element":
            raise error(f"orthogonalize() needs a matrix, a value per element; '{source.id}' is one value per "
                        f"{_UNITS[env.get(source.id, 'host')]}", source.loc)
    targets = {s.target for s, _ in calls}
    for stmt, call in calls:
        if stmt.target in kinds:
            raise error(f"{call.func}() must assign a temporary, not {kinds[stmt.target]} '{stmt.target}'",
                        stmt.target_loc, hint=f"'r = {call.func}(...)'")
    for stmt in walk_statements(spec.body):
        if isinstance(stmt, ir.Assign) and stmt.target in targets and all(stmt is not s for s, _ in calls):
            raise error(f"'{stmt.target}' holds the result of a function of the whole weight and cannot be assigned "
                        "again", stmt.target_loc, hint="assign to another temporary")
    first, last = bounds
    for stmt in walk_statements(spec.body[:last]):
        if isinstance(stmt, ir.Assign) and stmt.target == "param":
            where = (f"before the last function of the whole weight ({calls[0][1].func}() is the first)" if calls
                     else "before the last statement that reads or writes a value per row or column")
            raise error(f"'param' is assigned {where}; the weight is written once, after them", stmt.target_loc,
                        hint="move every 'param = ...' after them (weight decay included)")
    for stmt in walk_statements(spec.body[first:last]):
        e = stmt.condition if isinstance(stmt, ir.If) else stmt.value
        for call in iter_calls(e):
            if call.func == "stored":
                raise error("stored() rounds a value as the weight is stored, which only a phase's kernel does; this "
                            "statement is in the region (between the functions of the whole weight), which runs in "
                            "fp32", call.loc, hint="compute it before the first function of the whole weight or "
                            "after the last")
        if isinstance(stmt, ir.Assign) and kinds.get(stmt.target) == "state" and env[stmt.target] == "element":
            raise error(f"per-element state '{stmt.target}' is assigned between the functions of the whole weight, "
                        "which run on the whole weight in fp32 where the state's layout would have to be rounded",
                        stmt.target_loc, hint="assign it before the first of them (it can feed them) or after the "
                        "last; or declare it per row or per column ('state NAME[rows] = 0')")
    if spec.scalars:
        what = f"{calls[0][1].func}()" if calls else "states per row or column"
        raise error(f"a spec with {what} cannot have scalar state yet", spec.scalars[0].loc)


def _check_extents(spec: ir.Spec, env: Mapping[str, str], error) -> None:
    """A state per row (per column) starts from a number and takes values per row (per column) or per tensor;
    `orthogonalize`'s steps, coefficients and eps are known before the step (host)."""
    for s in spec.states:
        if s.extent is not None and s.starts_from_param:
            raise error(f"state '{s.name}' is one value per {s.unit}, so it cannot start from 'param'",
                        s.init.loc, hint="start it from a number: 'state NAME[rows] = 0'")
    for stmt in walk_statements(spec.body):
        if not isinstance(stmt, ir.Assign):
            continue
        declared = next((s for s in spec.states if s.name == stmt.target), None)
        value = _extent(stmt.value, env)
        if declared is not None and declared.extent is not None and _join(value, declared.extent) != declared.extent:
            raise error(f"state '{declared.name}' is one value per {declared.unit}, but this value is one per "
                        f"{_UNITS[value]}", stmt.value.loc,
                        hint=f"reduce it first: '{'rowmean' if declared.extent == 'rows' else 'colmean'}(x)'")
        if isinstance(stmt.value, ir.Call) and stmt.value.func == "orthogonalize":
            for arg in stmt.value.args[1:]:
                if _extent(arg, env) != "host":
                    raise error("orthogonalize()'s steps, coefficients and eps are keywords or numbers, known "
                                "before the step; this one is computed from the weight", arg.loc)
