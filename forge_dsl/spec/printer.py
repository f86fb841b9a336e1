"""The canonical `.fopt` text of a spec: `parse_spec(print_spec(s)) == s` for every spec.

Parentheses appear only where precedence needs them; numbers are printed in
their shortest exact form; declarations come in a fixed order (hyperparameters
in declaration order, then flags, choices, derived flags, states, scalars, requires).
"""

from __future__ import annotations

from . import ir

__all__ = ["print_spec", "print_expr"]

# Binding strength, loosest first.  Binary operators are left-associative except '**'.
_PRECEDENCE = {
    "or": 1,
    "and": 2,
    "not": 3,
    "lt": 4, "le": 4, "gt": 4, "ge": 4, "eq": 4, "ne": 4,
    "add": 5, "sub": 5,
    "mul": 6, "div": 6,
    "neg": 7,
    "pow": 8,
}
_SYMBOL = {
    "or": "or", "and": "and",
    "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!=",
    "add": "+", "sub": "-", "mul": "*", "div": "/", "pow": "**",
}
_ATOM = 9


def _prec(e: ir.Expr) -> int:
    if isinstance(e, ir.Binary):
        return _PRECEDENCE[e.op]
    if isinstance(e, ir.Unary):
        return _PRECEDENCE[e.op]
    if isinstance(e, ir.Num) and e.value < 0:
        return _PRECEDENCE["neg"]
    return _ATOM


def print_expr(e: ir.Expr) -> str:
    if isinstance(e, ir.Num):
        return ir.format_number(e.value)
    if isinstance(e, ir.BoolLit):
        return "true" if e.value else "false"
    if isinstance(e, ir.Name):
        return e.id
    if isinstance(e, ir.Call):
        return f"{e.func}({', '.join(print_expr(a) for a in e.args)})"
    if isinstance(e, ir.Index):
        return f"{_wrap(e.base, _ATOM)}[{', '.join(print_expr(a) for a in e.indices)}]"
    if isinstance(e, ir.Given):
        return f"given({e.name})"
    if isinstance(e, ir.Text):
        return _quoted(e.value)
    if isinstance(e, ir.Method):
        base = _wrap(e.base, _ATOM)
        if isinstance(e.base, ir.Num):
            base = f"({base})"
        return f"{base}.{e.method}({', '.join(print_expr(a) for a in e.args)})"
    if isinstance(e, ir.Attribute):
        base = _wrap(e.base, _ATOM)
        if isinstance(e.base, ir.Num):  # `2.sum` would read as the number `2.` then `sum`
            base = f"({base})"
        return f"{base}.{e.attr}"
    if isinstance(e, ir.Unary):
        if e.op == "neg":
            # '-' binds looser than '**' and tighter than '*': -x ** 2 is -(x ** 2).
            return "-" + _wrap(e.operand, _PRECEDENCE["neg"])
        return "not " + _wrap(e.operand, _PRECEDENCE["not"])
    if isinstance(e, ir.Binary):
        p = _PRECEDENCE[e.op]
        if e.op == "pow":  # right-associative; its right operand is a unary expression
            left = _wrap(e.left, _ATOM)
            right = _wrap(e.right, _PRECEDENCE["neg"])
        elif e.op in ("lt", "le", "gt", "ge", "eq", "ne"):  # not chainable
            left, right = _wrap(e.left, p + 1), _wrap(e.right, p + 1)
        else:
            left, right = _wrap(e.left, p), _wrap(e.right, p + 1)
        return f"{left} {_SYMBOL[e.op]} {right}"
    raise AssertionError(e)


def _wrap(e: ir.Expr, min_prec: int) -> str:
    text = print_expr(e)
    return f"({text})" if _prec(e) < min_prec else text


def _number(v: float) -> str:
    return ir.format_number(v)


def _quoted(word: str) -> str:
    return f'"{word}"'


def _interval(iv: ir.Interval) -> str:
    return "" if iv == ir.UNBOUNDED else f" in {iv}"


def _stmts(body, indent: str) -> list[str]:
    out: list[str] = []
    for s in body:
        if isinstance(s, ir.Assign):
            out.append(f"{indent}{s.target} = {print_expr(s.value)}")
        else:
            out.extend(_if(s, indent, prefix="if"))
    return out


def _if(s: ir.If, indent: str, prefix: str) -> list[str]:
    out = [f"{indent}{prefix} {print_expr(s.condition)} {{"]
    out += _stmts(s.then, indent + "    ")
    if not s.orelse:
        out.append(f"{indent}}}")
    elif len(s.orelse) == 1 and isinstance(s.orelse[0], ir.If):
        tail = _if(s.orelse[0], indent, prefix="} else if")
        out += tail
    else:
        out.append(f"{indent}}} else {{")
        out += _stmts(s.orelse, indent + "    ")
        out.append(f"{indent}}}")
    return out


def print_spec(spec: ir.Spec) -> str:
    """The spec as canonical `.fopt` text."""
    lines = [f"optimizer {spec.name}" + (f' "{spec.doc}"' if spec.doc is not None else ""), ""]
    emitted_groups: set[str] = set()
    groups = {g.name: g for g in spec.groups}
    by_name = {h.name: h for h in spec.hypers}
    for h in spec.hypers:
        if h.group is None:
            default = " = none" if h.optional else f" = {_number(h.default)}" if h.default is not None else ""
            lines.append(f"hyper {h.name}{default}{_interval(h.interval)}")
        elif h.group not in emitted_groups:
            g = groups[h.group]
            emitted_groups.add(g.name)
            members = ", ".join(f"{m} = {'none' if by_name[m].optional else _number(by_name[m].default)}"
                                for m in g.members)
            lines.append(f"hyper {g.name} = ({members}){_interval(g.interval)}")
    for f in spec.flags:
        lines.append(f"flag {f.name} = {'true' if f.default else 'false'}")
    for c in spec.choices:
        default = "none" if c.default is None else _quoted(c.default)
        lines.append(f"choice {c.name} = {default} in ({', '.join(map(_quoted, c.values))})")
    for d in spec.derived:
        lines.append(f"flag {d.name} = {print_expr(d.expr)}")
    for s in spec.states:
        text = f"state {s.name}{'' if s.extent is None else f'[{s.extent}]'} = {print_expr(s.init)}"
        if s.nonneg:
            text += " nonneg"
        if s.exact:
            text += " exact"
        if s.condition is not None:
            text += f" if {print_expr(s.condition)}"
        lines.append(text)
    for s in spec.scalars:
        lines.append(f"scalar {s.name} = {print_expr(s.init)}")
    for r in spec.requires:
        lines.append(f'require {print_expr(r.condition)}, "{r.message}"')
    lines += ["", "update {"] + _stmts(spec.body, "    ") + ["}", ""]
    return "\n".join(lines)
