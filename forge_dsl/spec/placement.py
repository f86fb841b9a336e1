"""Where the functions of the whole weight (`names.BARRIER_FUNCTIONS`: `orthogonalize`, `norm`, ...) may stand in
an update: the checker's rule, kept beside it so that `phases` can split the update there without checking again."""

from __future__ import annotations

from typing import Mapping

from . import ir
from .errors import SpecError
from .names import BARRIER_FUNCTIONS, PER_TENSOR_FUNCTIONS
from .variants import iter_calls, walk_statements

__all__ = ["check_barrier_placement"]


def check_barrier_placement(spec: ir.Spec, kinds: Mapping[str, str]) -> None:
    """Functions of the whole weight stand together: each the whole value of a statement of the update's own (not
    inside an 'if'), the statements one after another (the barrier stage, between the tile and the post phase),
    each assigning a temporary of its own that nothing else assigns and no other of them reads, at most one of
    them a matrix (`orthogonalize`); `param` is assigned after them only (the weight is written once, by the last
    phase); no scalar state. `kinds`: each declared or built-in name -> its kind, for messages.

    Raises:
        SpecError: located at the call or statement that breaks the rule.
    """
    def error(message: str, loc, hint=None) -> SpecError:
        return SpecError(message, loc, spec.source, hint)

    top = {id(s.value) for s in spec.body if isinstance(s, ir.Assign)}
    seen: list[ir.Call] = []
    for stmt in walk_statements(spec.body):
        e = stmt.condition if isinstance(stmt, ir.If) else stmt.value
        for call in iter_calls(e):
            if call.func not in BARRIER_FUNCTIONS:
                continue
            if call is not e or id(e) not in top:
                raise error(f"{call.func}() reads the whole weight, so it must be the whole value of a statement of "
                            "its own, outside any 'if'", call.loc,
                            hint=f"write 'r = {call.func}(...)' and use 'r' after it")
            seen.append(call)
    if not seen:
        return
    stage = [next(s for s in spec.body if isinstance(s, ir.Assign) and s.value is call) for call in seen]
    first = spec.body.index(stage[0])
    for i, stmt in enumerate(stage):
        if spec.body.index(stmt) != first + i:
            raise error(f"{stmt.value.func}() is not next to {stage[0].value.func}(): the functions of the whole "
                        "weight run together, between the element-wise phases, so their statements follow one another",
                        stmt.loc, hint="move the statements between them before or after them")
    matrices = [s for s in stage if s.value.func not in PER_TENSOR_FUNCTIONS]
    if len(matrices) > 1:
        raise error("only one orthogonalize() per update is supported; this is the second", matrices[1].value.loc)
    targets = {s.target for s in stage}
    for stmt in stage:
        func = stmt.value.func
        if stmt.target in kinds:
            raise error(f"{func}() must assign a temporary, not {kinds[stmt.target]} '{stmt.target}'",
                        stmt.target_loc, hint=f"'r = {func}(...)'")
        source = stmt.value.args[0]
        if isinstance(source, ir.Name) and source.id in targets:
            raise error(f"{func}() reads '{source.id}', the result of another function of the whole weight; each "
                        "reads what the tile phase left (states, the weight, temporaries before them)", source.loc)
    for stmt in walk_statements(spec.body):
        if isinstance(stmt, ir.Assign) and stmt.target in targets and stmt not in stage:
            raise error(f"'{stmt.target}' holds the result of a function of the whole weight and cannot be assigned "
                        "again", stmt.target_loc, hint="assign to another temporary")
    func = stage[0].value.func
    for stmt in walk_statements(spec.body[:first]):
        if isinstance(stmt, ir.Assign) and stmt.target == "param":
            raise error(f"'param' is assigned before {func}(); the weight is written once, after it",
                        stmt.target_loc, hint="move every 'param = ...' after it (weight decay included)")
    if spec.scalars:
        raise error(f"a spec with {func}() cannot have scalar state yet", spec.scalars[0].loc)
