"""The typed IR of a parsed spec: frozen dataclasses, each with its source location.

Locations are excluded from equality (`compare=False`), so two specs that say
the same thing compare equal whatever their layout; the round-trip test relies
on this.  Nothing here knows about grammar, checks or code generation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Union

from .errors import Loc

NO_LOC = Loc("<none>", 0, 0)


def _loc() -> Loc:
    return field(default=NO_LOC, compare=False, repr=False)


# ----------------------------------------------------------------------------
# Expressions
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Num:
    value: float
    loc: Loc = _loc()


@dataclass(frozen=True)
class BoolLit:
    value: bool
    loc: Loc = _loc()


@dataclass(frozen=True)
class Name:
    id: str
    loc: Loc = _loc()


@dataclass(frozen=True)
class Unary:
    """`op` is 'neg' or 'not'."""

    op: str
    operand: "Expr"
    loc: Loc = _loc()


@dataclass(frozen=True)
class Binary:
    """Arithmetic ('add', 'sub', 'mul', 'div', 'pow'), comparison ('lt', 'le', 'gt',
    'ge', 'eq', 'ne') or logic ('and', 'or')."""

    op: str
    left: "Expr"
    right: "Expr"
    loc: Loc = _loc()


@dataclass(frozen=True)
class Call:
    func: str
    args: tuple["Expr", ...]
    loc: Loc = _loc()
    func_loc: Loc = _loc()


@dataclass(frozen=True)
class Index:
    """`x[i]`: parsed only to be refused with a clear message (not element-wise)."""

    base: "Expr"
    indices: tuple["Expr", ...]
    loc: Loc = _loc()


@dataclass(frozen=True)
class Attribute:
    """`x.sum`: parsed only to be refused with a clear message (not element-wise)."""

    base: "Expr"
    attr: str
    loc: Loc = _loc()


@dataclass(frozen=True)
class Method:
    """`x.norm()`, `x.mean(0)`: parsed only to be refused with a clear message (not element-wise)."""

    base: "Expr"
    method: str
    args: tuple["Expr", ...]
    loc: Loc = _loc()


@dataclass(frozen=True)
class Given:
    """`given(name)`: whether the optional hyperparameter `name` (declared `= none`) has a value.

    Allowed only in derived flags and `require` conditions; see `Hyper.optional`.
    """

    name: str
    loc: Loc = _loc()


@dataclass(frozen=True)
class Text:
    """A quoted word, `"match_rms_adamw"`: compared with a `choice` keyword, in a derived flag or a `require`."""

    value: str
    loc: Loc = _loc()


Expr = Union[Num, BoolLit, Name, Unary, Binary, Call, Index, Attribute, Method, Given, Text]

ARITHMETIC_OPS = ("add", "sub", "mul", "div", "pow")
COMPARISON_OPS = ("lt", "le", "gt", "ge", "eq", "ne")
LOGIC_OPS = ("and", "or")
COMPARE_SYMBOLS = {"<": "lt", "<=": "le", ">": "gt", ">=": "ge", "==": "eq", "!=": "ne"}

# Built-in functions whose value is per element whatever their arguments: `stored(x)`, x rounded as this
# element's weight is stored (the weight's dtype, the step's rounding, stochastically this element's random
# bits). The checker gives them the per-element level; the lowering never folds nor hoists them.
ELEMENT_FUNCTIONS = frozenset({"stored"})

# ----------------------------------------------------------------------------
# Declarations
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Interval:
    """The valid range of a hyperparameter, e.g. `[0, 1)`."""

    low: float = -math.inf
    high: float = math.inf
    low_closed: bool = True
    high_closed: bool = True

    def contains(self, x: float) -> bool:
        if math.isnan(x):
            return False
        above = x >= self.low if self.low_closed else x > self.low
        below = x <= self.high if self.high_closed else x < self.high
        return above and below

    def __str__(self) -> str:
        def bound(v: float) -> str:
            if math.isinf(v):
                return "inf" if v > 0 else "-inf"
            return format_number(v)

        return (
            ("[" if self.low_closed else "(")
            + f"{bound(self.low)}, {bound(self.high)}"
            + ("]" if self.high_closed else ")")
        )


UNBOUNDED = Interval()


@dataclass(frozen=True)
class Hyper:
    """A real hyperparameter; `default` None means the keyword is required, unless `optional`.

    A member of a tuple keyword (torch's `betas=(b1, b2)`) has `group` set to
    the tuple's name and `index` to its position in it.

    `optional` (written `hyper t = none in [1, inf)`, like AdEMAMix's
    `t_alpha_beta3=None`): the keyword accepts None, which is also its default
    (`default` is None).  `config.resolve_hypers` then gives it the value None,
    and a derived flag `flag has_t = given(t)` tells whether it has a value.  The
    checker proves that the update reads it only in flag combinations where such a
    flag is true, and that nothing else (derived flags, `require`, initial values)
    reads its value, so no stage ever computes with None.
    """

    name: str
    default: Optional[float]
    interval: Interval = UNBOUNDED
    group: Optional[str] = None
    index: Optional[int] = None
    optional: bool = False
    loc: Loc = _loc()
    default_loc: Loc = _loc()  # where the default's number is written (its sign included)


@dataclass(frozen=True)
class HyperGroup:
    """A tuple keyword, e.g. `betas = (beta1 = 0.9, beta2 = 0.999)`."""

    name: str
    members: tuple[str, ...]
    interval: Interval = UNBOUNDED
    loc: Loc = _loc()


@dataclass(frozen=True)
class Flag:
    """A boolean keyword that selects code when the kernel is compiled."""

    name: str
    default: bool
    loc: Loc = _loc()


@dataclass(frozen=True)
class Choice:
    """A keyword that takes one of a few words, as torch.optim.Muon's `adjust_lr_fn="match_rms_adamw"`:
    `choice adjust_lr_fn = none in ("original", "match_rms_adamw")`. `default` is one of `values`, or None
    (written `none`: the keyword also accepts None, its default). Only derived flags and `require`s read it,
    by comparing it with one of its words (`flag f = adjust_lr_fn == "match_rms_adamw"`); the words are
    identifiers, so nothing but a flag's value reaches generated code."""

    name: str
    default: Optional[str]
    values: tuple[str, ...]
    loc: Loc = _loc()


@dataclass(frozen=True)
class DerivedFlag:
    """A flag computed from hyperparameters and flags (e.g. `momentum > 0`); not a keyword."""

    name: str
    expr: Expr
    loc: Loc = _loc()


@dataclass(frozen=True)
class State:
    """Per-element optimizer state, shaped like the parameter.

    `init`, the value every element starts at, is one of (checked by the checker):
      * `Num(v)` or `Unary('neg', Num(v))`: the number v (or -v);
      * `Name(h)` or `Unary('neg', Name(h))`: hyperparameter h's value (or its negation);
      * `Name('param')` or `Unary('neg', Name('param'))`: a copy of the weight (or its
        negation), element by element, taken when the state is created (schedule-free
        AdamW's z, MADGRAD's x0); see `starts_from_param`.
    `nonneg` declares that it never goes below zero (int8 layouts then use the
    unsigned map); `exact` (written `state z = param exact`) that it must be stored
    exactly: in fp32, never in a bf16 or int8 layout; `condition`, a flag
    expression, says when the state exists at all. `extent` (written
    `state r[rows] = 0`) makes it one value per row ("rows": [rows]) or per column
    ("cols": [cols]) of the weight (`phases.shape_values`), not per element: such a state
    starts from a number, is kept in fp32 and is read and written only on the whole
    weight, between the phases (docs/LANGUAGE.md, section 9.1).
    """

    name: str
    init: Expr
    nonneg: bool = False
    condition: Optional[Expr] = None
    exact: bool = False
    loc: Loc = _loc()
    extent: Optional[str] = None

    @property
    def starts_from_param(self) -> bool:
        """True when `init` is `param` or `-param`: the state starts as (minus) a copy of the weight."""
        _, e = initial_parts(self.init)
        return isinstance(e, Name) and e.id == "param"

    @property
    def unit(self) -> str:
        """What it holds one value per: "element", "row" or "column"."""
        return {None: "element", "rows": "row", "cols": "column"}[self.extent]

    @property
    def must_stay_exact(self) -> bool:
        """Whether every layout must keep this state in fp32: declared `exact`, or it starts
        from `param` (it holds weight-like values, which a bf16 or int8 code would ruin), or it
        is per row or per column (`extent`: a few numbers per weight, kept whole)."""
        return self.exact or self.starts_from_param or self.extent is not None


@dataclass(frozen=True)
class ScalarState:
    """Per-tensor scalar state (e.g. NAdam's running mu product), updated once per step."""

    name: str
    init: Expr
    loc: Loc = _loc()


@dataclass(frozen=True)
class Require:
    """A check on hyperparameters and flags, raised as ValueError(message) when false."""

    condition: Expr
    message: str
    loc: Loc = _loc()


# ----------------------------------------------------------------------------
# Statements and the spec
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Assign:
    target: str
    value: Expr
    loc: Loc = _loc()
    target_loc: Loc = _loc()


@dataclass(frozen=True)
class If:
    """A compile-time branch: `condition` may use flags only."""

    condition: Expr
    then: tuple["Stmt", ...]
    orelse: tuple["Stmt", ...] = ()
    loc: Loc = _loc()


Stmt = Union[Assign, If]


@dataclass(frozen=True)
class Spec:
    """One optimizer, as written in a `.fopt` file.

    Attributes:
        name: the optimizer's name (`optimizer adamw`).
        doc: the optional one-line description after the name.
        hypers: every real hyperparameter, tuple members included, in order.
        groups: tuple keywords.
        flags: boolean keywords.
        derived: flags computed from hyperparameters (and choices).
        states: per-element states.
        scalars: per-tensor scalar states.
        requires: cross-hyperparameter checks.
        body: the update, as statements.
        choices: keywords that take one of a few words.
        path: the file it came from (for messages); not compared.
        source: its text (for messages); not compared.
    """

    name: str
    doc: Optional[str]
    hypers: tuple[Hyper, ...]
    groups: tuple[HyperGroup, ...]
    flags: tuple[Flag, ...]
    derived: tuple[DerivedFlag, ...]
    states: tuple[State, ...]
    scalars: tuple[ScalarState, ...]
    requires: tuple[Require, ...]
    body: tuple[Stmt, ...]
    choices: tuple[Choice, ...] = ()
    path: str = field(default="<string>", compare=False, repr=False)
    source: str = field(default="", compare=False, repr=False)
    loc: Loc = _loc()

    # Convenient views -------------------------------------------------------
    @property
    def hyper_names(self) -> tuple[str, ...]:
        return tuple(h.name for h in self.hypers)

    @property
    def state_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.states)

    @property
    def flag_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.flags)

    @property
    def scalar_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.scalars)

    def keyword_defaults(self) -> dict[str, object]:
        """torch-style keyword → default: tuples for groups, None where required."""
        out: dict[str, object] = {}
        grouped = {m for g in self.groups for m in g.members}
        by_name = {h.name: h for h in self.hypers}
        for h in self.hypers:
            if h.name not in grouped:
                out[h.name] = h.default
        for g in self.groups:
            out[g.name] = tuple(by_name[m].default for m in g.members)
        for f in self.flags:
            out[f.name] = f.default
        for c in self.choices:
            out[c.name] = c.default
        return out


def initial_parts(init: Expr) -> tuple[float, Expr]:
    """A state's or scalar state's initial value as (sign, base): `-x` is (-1.0, x), anything else
    (1.0, itself); the checker allows a number, a hyperparameter or `param` as the base."""
    if isinstance(init, Unary) and init.op == "neg":
        return -1.0, init.operand
    return 1.0, init


def format_number(v: float) -> str:
    """The shortest text that reads back as exactly `v` (`1e-08`, `0.9`, `2`)."""
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if v == int(v) and abs(v) < 1e16:
        return str(int(v))
    return repr(float(v))
