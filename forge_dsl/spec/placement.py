"""Where a function of the whole weight (`names.BARRIER_FUNCTIONS`, e.g. `orthogonalize`) may stand in an update:
the checker's rule, kept beside it so that `phases` can split the update there without checking again."""

from __future__ import annotations

from typing import Iterator, Mapping

from . import ir
from .errors import SpecError
from .names import BARRIER_FUNCTIONS
from .variants import children, walk_statements

__all__ = ["check_barrier_placement"]


def check_barrier_placement(spec: ir.Spec, kinds: Mapping[str, str]) -> None:
    """A function of the whole weight is the whole value of a statement of the update's own (not inside an 'if'),
    once, assigning a temporary; `param` is assigned after it only (the weight is written once, by the last phase);
    no scalar state. `kinds`: each declared or built-in name -> its kind, for messages.

    Raises:
        SpecError: located at the call or statement that breaks the rule.
    """
    def error(message: str, loc, hint=None) -> SpecError:
        return SpecError(message, loc, spec.source, hint)

    top = {id(s.value) for s in spec.body if isinstance(s, ir.Assign)}
    seen: list[ir.Call] = []
    for stmt in walk_statements(spec.body):
        e = stmt.condition if isinstance(stmt, ir.If) else stmt.value
        for call in _calls(e):
            if call.func not in BARRIER_FUNCTIONS:
                continue
            if call is not e or id(e) not in top:
                raise error(f"{call.func}() reads the whole weight, so it must be the whole value of a statement of "
                            "its own, outside any 'if'", call.loc,
                            hint=f"write 'o = {call.func}(...)' and use 'o' after it")
            seen.append(call)
    if len(seen) > 1:
        raise error("only one function of the whole weight per update is supported; this is the second", seen[1].loc)
    if not seen:
        return
    func = seen[0].func
    barrier = next(s for s in spec.body if isinstance(s, ir.Assign) and s.value is seen[0])
    if barrier.target in kinds:
        raise error(f"{func}() must assign a temporary, not {kinds[barrier.target]} '{barrier.target}'",
                    barrier.target_loc, hint=f"'o = {func}(...)'")
    for stmt in walk_statements(spec.body[:spec.body.index(barrier)]):
        if isinstance(stmt, ir.Assign) and stmt.target == "param":
            raise error(f"'param' is assigned before {func}(); the weight is written once, after it",
                        stmt.target_loc, hint="move every 'param = ...' after it (weight decay included)")
    if spec.scalars:
        raise error(f"a spec with {func}() cannot have scalar state yet", spec.scalars[0].loc)


def _calls(expr: ir.Expr) -> Iterator[ir.Call]:
    """Every call in `expr`, outermost first."""
    stack = [expr]
    while stack:
        e = stack.pop()
        if isinstance(e, ir.Call):
            yield e
        stack.extend(reversed(children(e)))
