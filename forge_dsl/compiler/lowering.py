"""Stage 3: a checked spec + one combination of flags → a `Lowered` program.

The body is evaluated symbolically into a DAG (hash-consed, so equal
subexpressions are computed once), with constant folding (float64, as the host
program) and the identities that are exact in IEEE arithmetic, NaN and zeros'
signs included (`x*1`, `x/1`, `x-0`, `x**1`, `-(-x)`, `x/2` as `x*0.5`,
`where(true, a, b)`, ...; not `x+0`, `0-x`, `x*0`, `x-x`, `x/x`).  Every node is then either

  * a **host scalar**: depends only on hyperparameters, the step and scalar
    state, so it is computed once per step per tensor on the host (in float64);
  * or **per-element**: depends on `param`, `grad` or a state, so it runs for
    every weight (in the kernel's epilogue, or in eager PyTorch for the
    reference step).

What the per-element program reads of the host program is rounded once to fp32
(docs/LANGUAGE.md, section 6); a division stays a division.  The program is
pure data: `reference.py` executes it eagerly, the code generator renders it
into Triton.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Union

from ..spec import ir
from ..spec.checker import Level, check_spec
from ..spec.phases import is_phased
from ..spec.scalar_ops import apply_scalar_op, fp32
from ..spec.variants import Combo, assignments, runtime_flags, specialize, states_present, variant_of, variants

__all__ = ["Operand", "Instr", "Lowered", "lower", "lower_all", "ELEMENT_INPUTS", "HOST_INPUTS"]

HOST_INPUTS = ("hyper", "flag", "step", "scalar")
ELEMENT_INPUTS = ("param", "grad", "state")


@dataclass(frozen=True)
class Operand:
    """An argument of an instruction.

    kind:
      'const'            a literal (`value` is a float or a bool);
      'hyper', 'flag', 'step', 'scalar'   host inputs, by name ('flag': a `variants.runtime_flags`
                         flag, a bool);
      'host'             a host scalar computed by `Lowered.host`;
      'param', 'grad', 'state'    per-element inputs (the values before the step);
      'elem'             a per-element value computed by `Lowered.elem`.
    """

    kind: str
    name: str = ""
    value: Union[float, bool, None] = None

    @property
    def is_host(self) -> bool:
        return self.kind in HOST_INPUTS or self.kind == "host"

    @property
    def is_element(self) -> bool:
        return self.kind in ELEMENT_INPUTS or self.kind == "elem"


@dataclass(frozen=True)
class Instr:
    """`name = op(*args)`; `type` is 'real' or 'bool'."""

    name: str
    op: str
    args: tuple[Operand, ...]
    type: str = "real"


@dataclass(frozen=True)
class Lowered:
    """One flag combination of a spec, split into host and per-element programs.

    Attributes:
        spec_name: the optimizer.
        combo: the flag values this program is for.
        states: per-element states present in this combination, in declaration order.
        host: the host program, in order; reads hyperparameters, `step` and scalar state.
        exports: host operands the per-element program reads (kernel scalar arguments).
        scalar_updates: (scalar state, new value) pairs, applied after the step.
        elem: the per-element program, in order.
        outputs: ('param' | state name, new value); `param` first, then states in order.
        element_inputs: the per-element inputs read ('param', 'grad', state names).
    """

    spec_name: str
    combo: Combo
    states: tuple[str, ...]
    host: tuple[Instr, ...]
    exports: tuple[Operand, ...]
    scalar_updates: tuple[tuple[str, Operand], ...]
    elem: tuple[Instr, ...]
    outputs: tuple[tuple[str, Operand], ...]
    element_inputs: tuple[str, ...]

    @property
    def flags(self) -> dict[str, bool]:
        return dict(self.combo)

    def describe(self) -> str:
        """A readable listing of both programs (for debugging and golden tests)."""

        def fmt(o: Operand) -> str:
            if o.kind == "const":
                v = o.value
                return ("true" if v else "false") if isinstance(v, bool) else ir.format_number(v)
            return o.name if o.kind not in ("param", "grad") else o.kind

        lines = [f"# {self.spec_name} [{', '.join(f'{k}={v}' for k, v in self.combo)}]", "host:"]
        lines += [f"  {i.name} = {i.op}({', '.join(fmt(a) for a in i.args)})" for i in self.host]
        lines.append("exports: " + ", ".join(fmt(o) for o in self.exports))
        lines += [f"  {s} <- {fmt(o)}" for s, o in self.scalar_updates]
        lines.append("element:")
        lines += [f"  {i.name} = {i.op}({', '.join(fmt(a) for a in i.args)})" for i in self.elem]
        lines += [f"  {t} <- {fmt(o)}" for t, o in self.outputs]
        return "\n".join(lines)


# ----------------------------------------------------------------------------
# The DAG
# ----------------------------------------------------------------------------

_BOOL_OPS = {"lt", "le", "gt", "ge", "eq", "ne", "and", "or", "not"}


@dataclass(eq=False)
class _Node:
    id: int
    kind: str  # 'const', 'in', 'op'
    op: str = ""
    args: tuple["_Node", ...] = ()
    value: Union[float, bool, None] = None
    input_kind: str = ""
    name: str = ""
    level: Level = Level.CONST
    type: str = "real"


class _Graph:
    def __init__(self) -> None:
        self.nodes: dict[tuple, _Node] = {}
        self.names: dict[int, str] = {}  # node id -> a user's name for it

    def _intern(self, key: tuple, **fields) -> _Node:
        node = self.nodes.get(key)
        if node is None:
            node = _Node(id=len(self.nodes), **fields)
            self.nodes[key] = node
        return node

    def const(self, value) -> _Node:
        if isinstance(value, bool):
            return self._intern(("const", "bool", value), kind="const", value=value, type="bool")
        value = float(value)
        return self._intern(("const", "real", repr(value)), kind="const", value=value)

    def input(self, input_kind: str, name: str) -> _Node:
        level = Level.HOST if input_kind in HOST_INPUTS else Level.ELEMENT
        typ = "bool" if input_kind == "flag" else "real"
        return self._intern(("in", input_kind, name), kind="in", input_kind=input_kind, name=name, level=level,
                            type=typ)

    def op(self, op: str, *args: _Node) -> _Node:
        if op in ir.ELEMENT_FUNCTIONS:  # never folded nor hoisted: per element whatever its arguments
            if args[0].kind == "op" and args[0].op == op:
                return args[0]  # stored(stored(x)) is stored(x): a stored value is stored unchanged
            return self._intern(("op", op) + tuple(a.id for a in args), kind="op", op=op, args=args,
                                level=Level.ELEMENT)
        simplified = self._simplify(op, args)
        if simplified is not None:
            return simplified
        level = max((a.level for a in args), default=Level.CONST)
        typ = "bool" if op in _BOOL_OPS or (op == "where" and args[1].type == "bool") else "real"
        return self._intern(("op", op) + tuple(a.id for a in args), kind="op", op=op, args=args, level=level, type=typ)

    def _simplify(self, op: str, args: tuple[_Node, ...]) -> Optional[_Node]:
        if all(a.kind == "const" for a in args):
            return self.const(apply_scalar_op(op, *(a.value for a in args)))

        def is_const(n: _Node, v) -> bool:
            return n.kind == "const" and n.type == "real" and n.value == v and math.copysign(1, n.value) > 0

        if op == "where" and args[0].kind == "const":
            return args[1] if args[0].value else args[2]
        if op == "where" and args[1] is args[2]:
            return args[1]
        if op == "mul":
            if is_const(args[0], 1.0):
                return args[1]
            if is_const(args[1], 1.0):
                return args[0]
        if op == "div" and is_const(args[1], 1.0):
            return args[0]
        if op == "div" and args[1].kind == "const" and _exact_reciprocal(args[1].value):
            return self.op("mul", args[0], self.const(1.0 / args[1].value))  # x / 2 is x * 0.5, bit for bit
        # x - 0 is x (-0.0 - 0 is -0.0); x + 0 is not (-0.0 + 0 is +0.0), nor 0 - x -x (0 - 0.0 is +0.0)
        if op == "sub" and is_const(args[1], 0.0):
            return args[0]
        if op == "pow" and is_const(args[1], 1.0):
            return args[0]
        if op == "neg" and args[0].kind == "op" and args[0].op == "neg":
            return args[0].args[0]
        if op == "not" and args[0].kind == "op" and args[0].op == "not":
            return args[0].args[0]
        if op in ("and", "or") and any(a.kind == "const" for a in args):
            c, other = (args[0], args[1]) if args[0].kind == "const" else (args[1], args[0])
            if op == "and":
                return other if c.value else self.const(False)
            return self.const(True) if c.value else other
        return None


def _exact_reciprocal(c) -> bool:
    """Whether dividing by the constant `c` is multiplying by `1 / c` in fp32 and float64 alike: `c` a power of
    two whose reciprocal fp32 holds too (both give the exact quotient rounded once; elsewhere they differ)."""
    if isinstance(c, bool) or not math.isfinite(c) or c == 0 or math.frexp(c)[0] not in (0.5, -0.5):
        return False
    return fp32(c) == c and fp32(1.0 / c) == 1.0 / c


def _build(graph: _Graph, expr: ir.Expr, env: dict[str, _Node]) -> _Node:
    if isinstance(expr, ir.Num):
        return graph.const(expr.value)
    if isinstance(expr, ir.BoolLit):
        return graph.const(expr.value)
    if isinstance(expr, ir.Name):
        return env[expr.id]
    if isinstance(expr, ir.Unary):
        return graph.op(expr.op, _build(graph, expr.operand, env))
    if isinstance(expr, ir.Binary):
        return graph.op(expr.op, _build(graph, expr.left, env), _build(graph, expr.right, env))
    if isinstance(expr, ir.Call):
        return graph.op(expr.func, *(_build(graph, a, env) for a in expr.args))
    raise AssertionError(f"unchecked expression reached lowering: {expr!r}")


# ----------------------------------------------------------------------------
# Lowering
# ----------------------------------------------------------------------------


def lower(spec: ir.Spec, combo: Combo) -> Lowered:
    """Lower a spec for one combination of flag values (see `variants.combinations`): the program of its
    compiled variant (`variants.variant_of`), which reads the runtime flags as host inputs.

    Raises:
        SpecError: `spec` is not valid. A spec from `load_spec` is checked already; one from `parse_spec`
            is checked here first (once), since lowering assumes what the checker proves.
        ValueError: `spec` runs in phases (`spec.phases`): each phase is lowered, not the spec.
    """
    if is_phased(_checked(spec)):
        raise ValueError(f"{spec.name} reads the whole weight or its shape, so it runs in phases, each its own "
                         f"kernel: ForgeOptimizer and reference_step run them; for the kernels, call them on "
                         f"forge_dsl.spec.phases.plan(spec).tile and .post (forge-gen --explain prints the plan)")
    return _lower_cached(_checked(spec), variant_of(spec, tuple(combo)))


_CHECKED: dict[int, ir.Spec] = {}  # id(spec) -> spec, for the specs `check_spec` passed
_CHECKED_MAX = 256


def _checked(spec: ir.Spec) -> ir.Spec:
    """`spec`, after `check_spec` passed it (once per spec object: a dict by identity, not a hash of the IR)."""
    if _CHECKED.get(id(spec)) is not spec:
        check_spec(spec)
        if len(_CHECKED) >= _CHECKED_MAX:
            _CHECKED.clear()
        _CHECKED[id(spec)] = spec
    return spec


@functools.lru_cache(maxsize=256)
def _lower_cached(spec: ir.Spec, combo: Combo) -> Lowered:
    flags = dict(combo)
    graph = _Graph()
    present = states_present(spec, flags)
    env: dict[str, _Node] = {}
    for h in spec.hypers:
        env[h.name] = graph.input("hyper", h.name)
    for name, value in combo:
        env[name] = graph.const(value)
    for name in runtime_flags(spec):
        env[name] = graph.input("flag", name)
    env["step"] = graph.input("step", "step")
    for s in spec.scalars:
        env[s.name] = graph.input("scalar", s.name)
    env["param"] = graph.input("param", "param")
    env["grad"] = graph.input("grad", "grad")
    for s in present:
        env[s.name] = graph.input("state", s.name)

    for stmt in specialize(spec.body, flags):
        node = _build(graph, stmt.value, env)
        env[stmt.target] = node
        if node.kind == "op":
            graph.names.setdefault(node.id, stmt.target)

    element_outputs = [("param", env["param"])] + [(s.name, env[s.name]) for s in present]
    scalar_outputs = [(s.name, env[s.name]) for s in spec.scalars]

    # Names: a user's temporary name where one bound the node, else tmpN; never reused.
    taken = {h.name for h in spec.hypers} | {s.name for s in spec.states} | {s.name for s in spec.scalars}
    taken |= {f.name for f in spec.flags} | {d.name for d in spec.derived} | {g.name for g in spec.groups}
    taken |= {c.name for c in spec.choices}
    taken |= {"param", "grad", "step"}
    taken |= {s.target for s in assignments(spec.body)}
    names: dict[int, str] = {}
    used_names: set[str] = set()
    counter = [0]

    def name_of(node: _Node) -> str:
        if node.id in names:
            return names[node.id]
        base = graph.names.get(node.id)
        if base is not None and base not in used_names and base not in {s.name for s in spec.states} | {s.name for s in spec.scalars} | {"param"}:
            chosen = base
        else:
            while True:
                chosen = f"tmp{counter[0]}"
                counter[0] += 1
                if chosen not in taken and chosen not in used_names:
                    break
        used_names.add(chosen)
        names[node.id] = chosen
        return chosen

    def operand(node: _Node) -> Operand:
        if node.kind == "const":
            return Operand("const", value=node.value)
        if node.kind == "in":
            return Operand(node.input_kind, node.name)
        return Operand("host" if node.level <= Level.HOST else "elem", name_of(node))

    # Topological order from the outputs (depth-first, args before users, first use first),
    # with an explicit stack: a chain of thousands of temporaries is a DAG that deep.
    order: list[_Node] = []
    seen: set[int] = set()
    for _, root in element_outputs + scalar_outputs:
        stack = [(root, False)]
        while stack:
            node, args_done = stack.pop()
            if args_done:
                if node.kind == "op":
                    order.append(node)
                continue
            if node.id in seen:
                continue
            seen.add(node.id)
            stack.append((node, True))
            stack.extend((a, False) for a in reversed(node.args))

    host_nodes = [n for n in order if n.level <= Level.HOST]
    elem_nodes = [n for n in order if n.level == Level.ELEMENT]

    exports: list[Operand] = []
    export_ids: set[int] = set()

    def export(node: _Node) -> None:
        if node.level <= Level.HOST and node.kind != "const" and node.id not in export_ids:
            export_ids.add(node.id)
            exports.append(operand(node))

    for n in elem_nodes:
        for a in n.args:
            export(a)
    for _, node in element_outputs:
        export(node)

    # Host program: only what exports and scalar updates need.
    by_id = {n.id: n for n in graph.nodes.values()}
    needed: set[int] = set()
    pending = [by_id[i] for i in export_ids] + [node for _, node in scalar_outputs]
    while pending:
        node = pending.pop()
        if node.id in needed or node.level > Level.HOST:
            continue
        needed.add(node.id)
        pending.extend(node.args)

    host = tuple(
        Instr(name_of(n), n.op, tuple(operand(a) for a in n.args), n.type) for n in host_nodes if n.id in needed
    )
    elem = tuple(Instr(name_of(n), n.op, tuple(operand(a) for a in n.args), n.type) for n in elem_nodes)
    outputs = tuple((name, operand(node)) for name, node in element_outputs)
    element_inputs = []
    for key in ["param", "grad"] + [s.name for s in present]:
        kind = key if key in ("param", "grad") else "state"
        # read by an instruction, or an output itself (`prev = grad`, `param = param`)
        if any(o.kind == kind and (kind != "state" or o.name == key)
               for o in [a for i in elem for a in i.args] + [o for _, o in outputs]):
            element_inputs.append(key)
    return Lowered(
        spec_name=spec.name,
        combo=combo,
        states=tuple(s.name for s in present),
        host=host,
        exports=tuple(exports),
        scalar_updates=tuple((name, operand(node)) for name, node in scalar_outputs),
        elem=elem,
        outputs=outputs,
        element_inputs=tuple(element_inputs),
    )


def lower_all(spec: ir.Spec) -> list[Lowered]:
    """One `Lowered` per compiled variant, in `variants.variants` order."""
    return [lower(spec, combo) for combo in variants(spec)]
