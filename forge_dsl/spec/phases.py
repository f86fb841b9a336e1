"""Stage 3 of a spec that reads the whole weight: its update split into element-wise phases around a region.

A function of the whole weight (`names.BARRIER_FUNCTIONS`: `o = orthogonalize(u, ...)`, `n = norm(x)`,
`r = rowmean(x)`) cannot run on one tile of the weight while its gradient is in registers: it needs every element
of its input. The update is split at the **region** (`placement.region_bounds`: from the first such statement to
the last that calls one or touches a value per row or column):

  * the **tile phase**, the statements before the region: an element-wise spec of its own, fused into the layer's
    dW tiles (or stepped from a gradient) as every spec is. It updates the per-element states and hands over, per
    element, the values the rest reads that are not states (`transients`: `grad` and temporaries read after it).
    It leaves the weight as it is (`param = param`).
  * the **region**, on the whole weight of one layer right after that layer's tile phase, in fp32 torch
    (`barriers.run_region`): its functions of the whole weight, the states per row or per column, and whatever
    arithmetic stands between them.
  * the **post phase**, the statements after it: an element-wise spec whose `grad` is a value per element the region
    computed (the `orthogonalize` result), or the gradient handed over; the values per tensor the region computed
    (a norm, and arithmetic on it) are its keywords. It writes the weight (once, with the step's rounding) and any
    state assigned there.

A transient lives for one layer's update only: one scratch tensor shaped like the weight, fp32, never in the
optimizer's state dict. A spec that reads the weight's shape (`rows`, `cols`, `ndim`, `param_eps`) without a
region is planned as its tile phase alone. Both phases are ordinary specs (their canonical text, `print_spec`), so
the compiler, the loader's cache, the reference step and forge-test treat them as any other; their keywords are
the spec's own (tuples flattened into their members) and the weight's shape values where they read them.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Mapping, Optional

from . import ir
from .checker import check_spec
from .errors import Loc, SpecError
from .names import BARRIER_FUNCTIONS, SHAPE_VALUES
from .placement import extents, region_bounds
from .parser import parse_spec
from .printer import print_spec
from .variants import assignments, children, iter_names, walk, walk_statements

__all__ = ["Barrier", "Plan", "extent_size", "is_phased", "plan", "shape_values"]

TILE_SUFFIX = "_tile"
POST_SUFFIX = "_post"
KEPT_PREFIX = "kept_"


@dataclass(frozen=True)
class Barrier:
    """`target = func(source, *args)`: one function of the whole weight between the phases.

    Attributes:
        func: its name (`orthogonalize`, `norm`, `sum`, `mean`, `rowmean`, `colmean`).
        target: the temporary it assigns.
        source: what it reads: `param` (the weight, unchanged by the tile phase), a state of the spec, a transient
            or a value the region computed before it.
        args: its other arguments (orthogonalize's steps, a, b, c, eps), one value per tensor: expressions of the
            keywords, `step` and the weight's shape values (`barriers.run_region` evaluates them).
        loc: where it is written.
    """

    func: str
    target: str
    source: str
    args: tuple[ir.Expr, ...]
    loc: Loc


@dataclass(frozen=True)
class Plan:
    """What a spec runs as, phase by phase.

    Attributes:
        spec: the spec planned.
        tile: the tile phase, a checked element-wise spec named `<name>_tile`.
        barriers: the functions of the whole weight in the region, in order (none: a spec that reads only the
            weight's shape).
        post: the post phase, a checked element-wise spec named `<name>_post`, or None without a region.
        transients: per-element values handed over for one layer (named `kept_<value>`), fp32, never saved: the
            tile phase's (its extra states) and then those the region writes for the post phase.
        shape_keywords: `rows`, `cols`, ... -> the keyword a phase reads it as (the phases declare the weight's
            shape values as hyperparameters of their own: the names are built in, not declarable).
        post_grad: what the post phase reads as its `grad`: a value per element the region computed, a transient
            (the gradient handed over), or None (it reads none).
        region: the region's statements, reading the tile phase's values under their transients' names.
        results: the values per tensor the region computes that the post phase reads (its keywords).
        region_kept: a value per element the region computes that the post phase reads besides its `grad` -> the
            transient it is written to.
    """

    spec: ir.Spec
    tile: ir.Spec
    barriers: tuple[Barrier, ...]
    post: Optional[ir.Spec]
    transients: tuple[str, ...]
    shape_keywords: Mapping[str, str]
    post_grad: Optional[str] = None
    region: tuple[ir.Stmt, ...] = ()
    results: tuple[str, ...] = ()
    region_kept: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @functools.cached_property
    def region_last_reads(self) -> dict[str, int]:
        """Each name the region reads -> the index of the last of its top-level statements that reads it (so
        `barriers.run_region` drops a temporary after it)."""
        out: dict[str, int] = {}
        for i, stmt in enumerate(self.region):
            for e in _expressions((stmt,)):
                for n in iter_names(e):
                    out[n.id] = i
        return out

    def keywords(self, phase: ir.Spec, cfg, shape, param_eps: float,
                 results: Optional[Mapping[str, float]] = None) -> dict:
        """`phase`'s keyword values: the spec's resolved keywords `cfg` (a `keywords.StepConfig`: its hypers, tuple
        members by name, its flags and choices), the weight's `shape` and its dtype's `param_eps` as `rows`, `cols`,
        `ndim`, `param_eps`, and the region's per-tensor `results` by name."""
        hypers, flags = cfg.hypers, cfg.flags
        shape_of = {keyword: value for name, value in shape_values(shape, param_eps).items()
                    for keyword in [self.shape_keywords.get(name)] if keyword is not None}
        results = results or {}
        out: dict = {f.name: flags[f.name] for f in phase.flags}
        out.update({c.name: cfg.choices[c.name] for c in phase.choices})
        for h in phase.hypers:
            out[h.name] = shape_of[h.name] if h.name in shape_of else results[h.name] if h.name in results \
                else hypers[h.name]
        return out

    @property
    def phases(self) -> tuple[ir.Spec, ...]:
        return (self.tile,) if self.post is None else (self.tile, self.post)

    def describe(self) -> str:
        """The plan as `forge-gen --explain` prints it: phases, extra work, transient bytes per layer."""
        lines = [f"{self.spec.name}: {len(self.phases)} phase{'s' if self.post is not None else ''}"]
        updated = _names(s.name for s in self.tile.states if s.name not in self.transients and any(
            a.target == s.name and not (isinstance(a.value, ir.Name) and a.value.id == s.name)
            for a in assignments(self.tile.body)))
        lines.append(f"  1. tile phase ({self.tile.name}): element-wise, fused into each layer's dW tiles in backward "
                     f"(or stepped from .grad); updates {updated or 'no state'}; leaves the weight as it is")
        if self.transients:
            lines.append(f"     hands over {len(self.transients)} transient{'s' if len(self.transients) > 1 else ''} "
                         f"({', '.join(self.transients)}): {4 * len(self.transients)} bytes per weight element "
                         "(fp32), one layer's at a time, allocated once per weight shape")
        if self.region:
            funcs = ", ".join(f"{b.target} = {b.func}({b.source})" for b in self.barriers)
            lines.append(f"  2. region, on the whole weight of one layer right after its tile phase, in fp32 torch: "
                         f"{funcs}; {len(self.region)} statement{'s' if len(self.region) > 1 else ''}; no dW "
                         "recomputed")
            if any(b.func == "orthogonalize" for b in self.barriers):
                lines.append("     orthogonalize in bfloat16 as torch.optim.Muon computes it: 3 GEMMs per Newton-"
                             "Schulz step (4·s²·l + 2·s³ flops, l × s the matrix, s its shorter side)")
            per_row = _names(f"{s.name}[{s.extent}]" for s in self.spec.states if s.extent is not None)
            if per_row:
                lines.append(f"     states per row / column: {per_row} (fp32, a number per row or column of the "
                             "weight)")
            if self.results:
                lines.append(f"     hands the post phase {_names(self.results)}: one value each per tensor, read back "
                             "to the host (one synchronization per layer)")
            if len(self.region) > len(self.barriers):
                lines.append("     its arithmetic per element holds fp32 temporaries shaped like the weight while it "
                             "runs")
        if self.post is not None:
            grad = f"grad := {self.post_grad}; " if self.post_grad is not None else ""
            lines.append(f"  3. post phase ({self.post.name}): element-wise on the whole weight, {grad}writes the "
                         "weight once (the step's rounding)")
        return "\n".join(lines)


def _names(names) -> str:
    return ", ".join(names)


def is_phased(spec: ir.Spec) -> bool:
    """Whether `spec` runs through a `Plan`: it calls a function of the whole weight or reads the weight's shape."""
    return region_bounds(spec) is not None or _reads_shape(spec.body)


def extent_size(shape, extent: str) -> int:
    """How many numbers a state declared `[rows]` or `[cols]` (`extent`) holds for a weight of this shape."""
    return int(shape_values(shape, 0.0)[extent])


def shape_values(shape, param_eps: float) -> dict[str, float]:
    """The per-tensor built-ins of a weight of this shape: `rows` (size(0)), `cols` (the product of the others; 1
    for a vector), `ndim`, and `param_eps`, the machine epsilon of the dtype the weight is stored in (given)."""
    rows = int(shape[0]) if len(shape) else 1
    cols = 1
    for n in shape[1:]:
        cols *= int(n)
    return {"rows": float(rows), "cols": float(cols), "ndim": float(len(shape)), "param_eps": float(param_eps)}


def _reads_shape(body) -> bool:
    return any(n.id in SHAPE_VALUES for e in _expressions(body) for n in iter_names(e))


def _expressions(body):
    for stmt in walk_statements(body):
        yield stmt.condition if isinstance(stmt, ir.If) else stmt.value


@functools.lru_cache(maxsize=64)
def plan(spec: ir.Spec) -> Plan:
    """Split a checked spec at its region (module docstring; `placement` checked where things stand).

    Raises:
        SpecError: a phase cannot be compiled (located at the region's first statement, with the phase's own
            message).
    """
    bounds = region_bounds(spec)
    taken = set(spec.hyper_names) | set(spec.state_names) | set(spec.flag_names) | {d.name for d in spec.derived} \
        | set(spec.scalar_names) | {s.target for s in assignments(spec.body)}
    shape = {name: _fresh("n_" + name, taken) for name in SHAPE_VALUES}
    shape_keywords = tuple(shape.values())
    element_states = tuple(s for s in spec.states if s.extent is None)
    if bounds is None:
        tile = _phase(spec, TILE_SUFFIX, tuple(_rename_stmt(s, shape) for s in spec.body), element_states,
                      spec.scalars, spec.loc, shape_keywords)
        return Plan(spec, tile, (), None, (), shape)
    first, last = bounds
    before, region, after = spec.body[:first], spec.body[first:last], spec.body[last:]
    state_names = set(spec.state_names)
    extent = extents(spec)
    assigned_before = {s.target for s in assignments(before)}
    assigned_in_region = {s.target for s in assignments(region)}
    read_after = [n for e in _expressions(region + after) for n in _read_names(e)]
    handed = [n for n in dict.fromkeys(read_after) if n == "grad" or (
        n in assigned_before and n not in state_names and n not in assigned_in_region)]
    kept = {name: _fresh(KEPT_PREFIX + name, taken) for name in handed}
    tile_body = tuple(_rename_stmt(s, shape) for s in before) + tuple(
        ir.Assign(k, ir.Name(name)) for name, k in kept.items()) + _keep(
        ["param"] + [s.name for s in element_states if s.name not in assigned_before])
    loc = region[0].loc
    tile_states = element_states + tuple(ir.State(k, ir.Num(0.0)) for k in kept.values())
    tile = _phase(spec, TILE_SUFFIX, tile_body, tile_states, (), loc, shape_keywords)
    region = tuple(_rename_stmt(s, kept) for s in region)
    barriers = tuple(Barrier(st.value.func, st.target, st.value.args[0].id, st.value.args[1:], st.loc)
                     for st in assignments(region) if isinstance(st.value, ir.Call)
                     and st.value.func in BARRIER_FUNCTIONS)
    post_reads = list(dict.fromkeys(n for e in _expressions(after) for n in _read_names(e)))
    from_region = [n for n in dict.fromkeys(st.target for st in assignments(region)) if n in post_reads]
    results = tuple(n for n in from_region if extent[n] in ("host", "tensor"))
    elements = [n for n in from_region if extent[n] == "element"]
    matrix = next((b.target for b in barriers if b.func == "orthogonalize" and b.target in elements), None)
    renamed = {**shape, **kept}
    post_grad = None
    if matrix is not None or (elements and "grad" not in post_reads):  # a value the region computed
        post_grad = matrix if matrix is not None else elements[0]
        renamed[post_grad] = "grad"
    elif "grad" in post_reads:  # the gradient itself, handed over
        post_grad = renamed.pop("grad")
    else:  # one transient it reads (read as an input, never written back)
        read = [n for n in post_reads if n in kept]
        if read:
            post_grad = kept[read[0]]
            renamed[read[0]] = "grad"
    region_kept = {n: _fresh(KEPT_PREFIX + n, taken) for n in elements if n != post_grad}
    renamed.update(region_kept)
    post_body = tuple(_rename_stmt(s, renamed) for s in after)
    post_reads = {n for e in _expressions(post_body) for n in _read_names(e)}
    post_assigned = {s.target for s in assignments(post_body)}
    transients = tuple(kept.values()) + tuple(region_kept.values())
    post_states = tuple(s for s in element_states if s.name in post_reads | post_assigned) + tuple(
        ir.State(k, ir.Num(0.0)) for k in transients if k in post_reads)
    post_body += _keep([s.name for s in post_states if s.name not in post_assigned])
    post = _phase(spec, POST_SUFFIX, post_body, post_states, (), loc, shape_keywords + results)
    return Plan(spec, tile, barriers, post, transients, shape, post_grad, region, results, region_kept)


def _fresh(name: str, taken: set) -> str:
    out, i = name, 2
    while out in taken:
        out, i = f"{name}{i}", i + 1
    taken.add(out)
    return out


def _keep(names) -> tuple[ir.Assign, ...]:
    """`x = x` for each name: a phase's checks want every state (and param) assigned; the value is unchanged."""
    return tuple(ir.Assign(n, ir.Name(n)) for n in names)


def _rename(e: ir.Expr, names: Mapping[str, str]) -> ir.Expr:
    if isinstance(e, ir.Name):
        return dataclasses.replace(e, id=names.get(e.id, e.id))
    if isinstance(e, ir.Unary):
        return dataclasses.replace(e, operand=_rename(e.operand, names))
    if isinstance(e, ir.Binary):
        return dataclasses.replace(e, left=_rename(e.left, names), right=_rename(e.right, names))
    if isinstance(e, ir.Call):
        return dataclasses.replace(e, args=tuple(_rename(a, names) for a in e.args))
    assert not children(e), e
    return e


def _rename_stmt(s: ir.Stmt, names: Mapping[str, str]) -> ir.Stmt:
    if isinstance(s, ir.Assign):
        return dataclasses.replace(s, target=names.get(s.target, s.target), value=_rename(s.value, names))
    return dataclasses.replace(s, condition=_rename(s.condition, names),
                               then=tuple(_rename_stmt(t, names) for t in s.then),
                               orelse=tuple(_rename_stmt(t, names) for t in s.orelse))


def _read_names(e: ir.Expr) -> set[str]:
    """The names `e` reads, those tested by given() included."""
    return {x.id if isinstance(x, ir.Name) else x.name for x in walk(e) if isinstance(x, (ir.Name, ir.Given))}


def _phase(spec: ir.Spec, suffix: str, body: tuple, states: tuple, scalars: tuple, loc: Loc,
           given: tuple[str, ...]) -> ir.Spec:
    """One phase as a checked spec with its canonical text: the declarations its body reads, tuples flattened, and
    `given` (the weight's shape, the per-tensor barriers' results) as keywords of its own where it reads them."""
    reads = {n for e in _expressions(body) for n in _read_names(e)}
    reads |= {n for s in states if s.condition is not None for n in _read_names(s.condition)}
    derived = tuple(d for d in spec.derived if d.name in reads)
    reads |= {n for d in derived for n in _read_names(d.expr)}
    reads |= {n for s in tuple(states) + tuple(scalars) for n in _read_names(s.init)}
    intervals = {g.name: g.interval for g in spec.groups}
    hypers = tuple(dataclasses.replace(h, group=None, index=None, interval=intervals.get(h.group, h.interval))
                   for h in spec.hypers if h.name in reads)
    hypers += tuple(ir.Hyper(name, 0.0) for name in given if name in reads)
    phase = ir.Spec(
        name=spec.name + suffix, doc=None, hypers=hypers, groups=(),
        flags=tuple(f for f in spec.flags if f.name in reads), derived=derived,
        states=tuple(states), scalars=tuple(scalars), requires=(), body=body,
        choices=tuple(c for c in spec.choices if c.name in reads))
    text = print_spec(phase)
    try:
        return check_spec(parse_spec(text, spec.path))  # the spec's path: the loader looks beside it
    except SpecError as err:
        raise SpecError(f"the {suffix[1:]} phase of this spec cannot be compiled: {err.message}", loc, spec.source,
                        "keep what runs before the barrier and what runs after it element-wise; "
                        "forge-gen --explain prints the phases") from None
