"""Stage 1: `.fopt` text → `ir.Spec`, through the Lark grammar in grammars/fopt.lark.

Syntax errors become `SpecError`s pointing at the offending token, with the
tokens that would have been accepted there in words.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import unicodedata
from importlib import resources
from typing import Optional

import lark
from lark import Lark, Token, Transformer, v_args

from . import ir
from .errors import (BIDI_CONTROLS, HIDING_CHARACTERS, Loc, SpecError, character_name, pasted_character_hint,
                     shown_character)
from .names import NOT_ELEMENT_WISE_HINT, STATE_EXTENTS

__all__ = ["parse_spec", "grammar_text"]


def grammar_text() -> str:
    """The text of grammars/fopt.lark (shipped inside the package as forge_dsl.grammars)."""
    return resources.files("forge_dsl.grammars").joinpath("fopt.lark").read_text()


@functools.lru_cache(maxsize=1)
def _parser() -> Lark:
    # The basic lexer makes every keyword (`update`, `true`, `not`, ...) a keyword
    # everywhere: a contextual lexer would read one as a NAME wherever a keyword
    # cannot stand, so `hyper true = 1` would declare an unusable name and
    # `x * not f` would fail far from the mistake.
    return Lark(grammar_text(), parser="lalr", lexer="basic", propagate_positions=True, maybe_placeholders=False)


# Deeper parse trees are refused: every later stage walks expressions recursively.
MAX_DEPTH = 200

# Names for the regex terminals Lark may report as expected, in a user's words.
# Terminals defined by a literal string are quoted as written ('{', 'update', '**').
_TOKEN_WORDS = {
    "NAME": "a name",
    "NUMBER": "a number",
    "STRING": 'a "string"',
    "COMPARE": "a comparison",
    "$END": "the end of the file",
}
# Terminals that can start an expression, and operators that can follow one.
_EXPR_START = {"NAME", "NUMBER", "LPAR", "MINUS", "PLUS", "TRUE", "FALSE", "INF", "NOT", "GIVEN", "STRING"}
_OPERATORS = {"PLUS", "MINUS", "STAR", "SLASH", "COMPARE", "AND", "OR", "DOT", "LSQB", "LPAR"}
_BRACKETS = {"LPAR": ("(", ")"), "LSQB": ("[", "]"), "LBRACE": ("{", "}")}
_CLOSERS = {"RPAR": "LPAR", "RSQB": "LSQB", "RBRACE": "LBRACE"}


@functools.lru_cache(maxsize=1)
def _literal_terminals() -> dict[str, str]:
    """Terminal name -> its literal text, for terminals defined by a string."""
    return {t.name: t.pattern.value for t in _parser().terminals if t.pattern.type == "str"}


def _is_keyword(tok: Token) -> bool:
    text = _literal_terminals().get(tok.type)
    return text is not None and text.isidentifier()


@functools.lru_cache(maxsize=1)
def _power_terminal() -> str:
    """The name Lark gives the anonymous '**' terminal."""
    return next((n for n, text in _literal_terminals().items() if text == "**"), "**")


def _word(name: str) -> Optional[str]:
    if name in _TOKEN_WORDS:
        return _TOKEN_WORDS[name]
    text = _literal_terminals().get(name)
    return f"'{text}'" if text is not None else None


def _describe_token(tok: Token) -> str:
    if tok.type == "$END" or tok.type == "":
        return "the end of the file"
    return f"'{tok.value}'"


def _expected_words(expected: set[str]) -> list[str]:
    expected = set(expected)
    groups = []
    if "NAME" in expected and "NUMBER" in expected:
        expected -= _EXPR_START
        groups.append("an expression")
    if "STAR" in expected:  # after an operand: every operator may follow
        expected -= _OPERATORS | {_power_terminal()}
        groups.append("an operator")
    words = sorted({w for w in map(_word, expected) if w is not None})
    # Symbols and keywords first, then descriptions ("a name", "an expression").
    quoted = [w for w in words if w.startswith("'")]
    described = sorted(set([w for w in words if not w.startswith("'")] + groups))
    return quoted + described


def _describe_expected(expected: set[str]) -> str:
    words = _expected_words(expected)
    if not words:
        return ""
    if len(words) > 10:
        words = words[:9] + ["..."]
    return "; expected " + (words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1])


def _accepted(err: lark.exceptions.UnexpectedToken) -> set[str]:
    """The terminals the parser accepts at the error.

    `err.expected` may list terminals that the LALR tables merged in from other
    contexts (e.g. `hyper` in the middle of an expression); asking the
    interactive parser gives the exact set.
    """
    try:
        if err.interactive_parser is not None:
            return set(err.interactive_parser.accepts())
    except Exception:  # pragma: no cover - fall back to Lark's own set
        pass
    return set(err.expected or ())


def _value_stack(err: lark.exceptions.UnexpectedToken) -> list:
    try:
        return list(err.interactive_parser.parser_state.value_stack)
    except Exception:  # pragma: no cover - internal API
        return []


def _end_loc(path: str, source: str) -> Loc:
    """Just after the last character that is not whitespace."""
    lines = source.rstrip().split("\n")
    return Loc(path, len(lines), len(lines[-1]) + 1)


def _closes(closer: str, opener: str) -> bool:
    # A range may mix its brackets (`[0, inf)`): ')' and ']' each close '(' or '['.
    return opener == "LBRACE" if closer == "RBRACE" else opener in ("LPAR", "LSQB")


def _unclosed_bracket(source: str) -> Optional[Token]:
    """The innermost '(', '[' or '{' that is never closed, if any."""
    stack: list[Token] = []
    try:
        for tok in _parser().lex(source):
            if tok.type in _BRACKETS:
                stack.append(tok)
            elif tok.type in _CLOSERS and stack and _closes(tok.type, stack[-1].type):
                stack.pop()
    except lark.exceptions.LarkError:
        return None
    return stack[-1] if stack else None


def _syntax_error(err: lark.exceptions.UnexpectedInput, path: str, source: str) -> SpecError:
    line, col = getattr(err, "line", 1) or 1, getattr(err, "column", 1) or 1
    if isinstance(err, lark.exceptions.UnexpectedCharacters):
        char = source[err.pos_in_stream] if err.pos_in_stream < len(source) else "?"
        if char == '"':
            bad = _bad_string_character(source, err.pos_in_stream)
            if bad is not None:
                return _string_character_error(path, source, bad)
        loc = Loc(path, line, col, line, col + 1)
        if char == "@":
            return SpecError("syntax error: '@' (a matrix product) is not in the language: an element's update reads "
                             "only its own param, grad and state", loc, source, NOT_ELEMENT_WISE_HINT)
        hint = 'a string is written "like this", on one line and without backslashes' if char == '"' else None
        return SpecError(f"syntax error: unexpected character {shown_character(char)}", loc, source,
                         hint or pasted_character_hint(char))
    if isinstance(err, lark.exceptions.UnexpectedToken):
        tok = err.token
        expected = _accepted(err)
        if tok.type == "$END":
            loc = _end_loc(path, source)
            if "UPDATE" in expected:  # between declarations: nothing is open, the block is missing
                return SpecError(
                    "syntax error: the spec has no update block",
                    loc,
                    source,
                    hint="a spec ends with its update, e.g. `update { param = param - lr * grad }`",
                )
            opener = _unclosed_bracket(source)
            if opener is not None and not ("NAME" in expected and "NUMBER" in expected):
                closer = _BRACKETS[opener.type][1]
                return SpecError(
                    f"syntax error: unexpected end of file: the '{opener.value}' on line {opener.line} is never closed",
                    loc,
                    source,
                    hint=f"add the missing '{closer}'",
                )
            return SpecError(
                "syntax error: unexpected end of file" + _describe_expected(expected),
                loc,
                source,
                hint="a spec ends with its `update { ... }` block; check for a missing '}' or ')'.",
            )
        end = col + len(str(tok.value)) if tok.value else col + 1
        loc = Loc(path, line, col, line, end)
        if tok.type == "COMPARE" and ("AND" in expected or "OR" in expected):
            # After a complete operand only a comparison is refused: a second one.
            return SpecError(
                "syntax error: comparisons cannot be chained",
                loc,
                source,
                hint="write 'a < b and b < c' instead of 'a < b < c'",
            )
        stack = _value_stack(err)
        if expected == {"EQUAL"} and stack and isinstance(stack[-1], Token) and stack[-1].type == "NAME":
            # `x = a b`: `b` was read as the start of the next statement.
            name = stack[-1]
            hint = None
            if len(stack) > 1 and isinstance(stack[-2], lark.Tree):
                hint = (
                    f"a statement is 'name = expression'; if '{name}' belongs to the expression "
                    "before it, an operator is missing"
                )
            return SpecError(
                f"syntax error: expected '=' after '{name}', found {_describe_token(tok)}",
                _token_loc(path, name),
                source,
                hint,
            )
        hint = None
        if _is_keyword(tok) and "NAME" in expected and "NUMBER" not in expected:
            hint = f"'{tok.value}' is a keyword of the language and cannot be used as a name"
        opener = _unclosed_bracket(source[: tok.start_pos]) if tok.start_pos is not None else None
        if hint is None and opener is not None and opener.line < line:
            closer = _BRACKETS[opener.type][1]
            if closer == ")" and "RPAR" in expected or closer == "]" and "RSQB" in expected:
                hint = f"the '{opener.value}' on line {opener.line} is never closed"
        return SpecError(
            f"syntax error: unexpected {_describe_token(tok)}" + _describe_expected(expected),
            loc,
            source,
            hint,
        )
    if isinstance(err, lark.exceptions.UnexpectedEOF):
        return SpecError("syntax error: unexpected end of file", _end_loc(path, source), source)
    return SpecError(f"syntax error: {err}", Loc(path, line, col), source)


def _loc_at(path: str, source: str, pos: int) -> Loc:
    """The one-character span at offset `pos` of `source` (lines counted at '\\n', as everywhere)."""
    line = source.count("\n", 0, pos) + 1
    col = pos - (source.rfind("\n", 0, pos) + 1) + 1
    return Loc(path, line, col, line, col + 1)


_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # a choice's word
_HIDING = re.compile("[" + "".join(sorted(HIDING_CHARACTERS)) + "]")


def _hiding_character_error(path: str, source: str, pos: int) -> SpecError:
    """A line break only editors see, or a bidirectional-text control, at `pos` (anywhere: a comment too)."""
    c = source[pos]
    if c in BIDI_CONTROLS:
        why = "it changes the order in which editors show the text around it"
        hint = ("delete it: a bidirectional-text control can make code look other than the compiler reads it "
                "(Trojan Source)")
    else:
        why = "editors may show a line break there, but the compiler reads none"
        hint = "use an ordinary newline: in a comment, what editors show after it on a new line is still the comment"
    return SpecError(f"the character {character_name(c)} is not allowed in a spec: {why}",
                     _loc_at(path, source, pos), source, hint)


def _bad_string_character(source: str, quote: int) -> Optional[int]:
    """The position of the first character a string may not hold, in the string opened at `quote`."""
    for i in range(quote + 1, len(source)):
        c = source[i]
        if c in '"\n':  # the end of the string, or an unterminated one (reported as such)
            return None
        if c == "\\" or not _string_character_ok(c):
            return i
    return None


def _string_character_ok(c: str) -> bool:
    if c == "\t":
        return True
    return unicodedata.category(c) not in ("Cc", "Cs", "Zl", "Zp")


def _string_character_error(path: str, source: str, pos: int) -> SpecError:
    c = source[pos]
    if c == "\\":
        what = "a backslash: strings have no escapes"
    else:
        what = f"the control character U+{ord(c):04X}"
    return SpecError(
        f"syntax error: a string may not contain {what}",
        _loc_at(path, source, pos),
        source,
        hint='a string is written "like this", on one line, with printable characters (tabs allowed) and '
        "without backslashes",
    )


def _tree_depth(tree: lark.Tree) -> tuple[int, Optional[lark.Tree]]:
    """The depth of the parse tree and its deepest subtree (iteratively)."""
    deepest, where = 0, None
    stack = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > deepest:
            deepest, where = depth, node
        for child in node.children:
            if isinstance(child, lark.Tree):
                stack.append((child, depth + 1))
    return deepest, where


def _too_deep(path: str, source: str, where=None) -> SpecError:
    meta = getattr(where, "meta", None)
    if meta is not None and not getattr(meta, "empty", True):
        loc = Loc(path, meta.line, meta.column)
    else:
        loc = Loc(path, 1, 1)
    return SpecError(
        f"the spec is nested too deeply (more than {MAX_DEPTH} levels)",
        loc,
        source,
        hint="split long expressions with temporaries",
    )



class _WrittenNumber(float):
    """A number of the spec with where it is written (`loc`), while the parser builds the IR: a hyperparameter's
    default keeps its place (`ir.Hyper.default_loc`); the IR itself holds plain floats."""

    loc: Loc

    def __new__(cls, value: float, loc: Loc) -> "_WrittenNumber":
        number = super().__new__(cls, value)
        number.loc = loc
        return number

@dataclasses.dataclass(frozen=True)
class _Extent:
    """A state's `[rows]` or `[cols]` while the parser builds the IR (`ir.State.extent`)."""

    name: str


def _token_loc(path: str, tok: Token) -> Loc:
    return Loc(path, tok.line, tok.column, tok.end_line, tok.end_column)


class _ToIR(Transformer):
    """Lark tree → IR nodes.  Positions come from `meta` (rules) or tokens."""

    def __init__(self, path: str, source: str) -> None:
        super().__init__()
        self.path = path
        self.source = source

    def _loc(self, meta) -> Loc:
        if getattr(meta, "empty", True):
            return ir.NO_LOC
        return Loc(self.path, meta.line, meta.column, meta.end_line, meta.end_column)

    def _number(self, tok: Token, negative: bool = False) -> float:
        value = float(tok.value)
        if math.isinf(value):
            raise SpecError(
                f"number '{tok.value}' is too large for a float", _token_loc(self.path, tok), self.source
            )
        if value == 0 and any(d in "123456789" for d in re.split("[eE]", tok.value)[0]):
            raise SpecError(
                f"number '{tok.value}' is too small for a float: it underflows to 0", _token_loc(self.path, tok),
                self.source, hint="the smallest positive float is about 4.9e-324 (fp32's, which the kernels compute "
                "in, about 1.4e-45); write 0 for zero",
            )
        return -value if negative else value

    # -- numbers and bounds ------------------------------------------------
    @v_args(meta=True)
    def signed_number(self, meta, children):
        return _WrittenNumber(self._number(children[0]), self._loc(meta))

    @v_args(meta=True)
    def negative_number(self, meta, children):
        return _WrittenNumber(self._number(children[0], negative=True), self._loc(meta))

    def pos_inf(self, children):
        return math.inf

    def neg_inf(self, children):
        return -math.inf

    def closed(self, children):
        return True

    def open(self, children):
        return False

    def interval(self, children):
        low_closed, low, high, high_closed = children
        return ir.Interval(float(low), float(high), low_closed, high_closed)

    # -- declarations ------------------------------------------------------
    @v_args(meta=True)
    def header(self, meta, children):
        name = children[0]
        doc = children[1].value[1:-1] if len(children) > 1 else None
        return ("header", str(name), doc, _token_loc(self.path, name))

    @v_args(meta=True)
    def hyper(self, meta, children):
        name, rest = children[0], children[1:]
        default: Optional[_WrittenNumber] = None
        optional = False
        interval = ir.UNBOUNDED
        for item in rest:
            if isinstance(item, ir.Interval):
                interval = item
            elif isinstance(item, Token):  # NONE
                optional = True
            else:
                default = item
        return ir.Hyper(str(name), None if default is None else float(default), interval, optional=optional,
                        loc=_token_loc(self.path, name), default_loc=ir.NO_LOC if default is None else default.loc)

    @v_args(meta=True)
    def component(self, meta, children):
        name, value = children
        return (str(name), value, _token_loc(self.path, name))

    @v_args(meta=True)
    def tuple_hyper(self, meta, children):
        name = children[0]
        interval = children[-1] if isinstance(children[-1], ir.Interval) else ir.UNBOUNDED
        comps = [c for c in children[1:] if isinstance(c, tuple)]
        members = tuple(
            ir.Hyper(cname, None, interval, group=str(name), index=i, optional=True, loc=cloc) if isinstance(
                value, Token) else
            ir.Hyper(cname, float(value), interval, group=str(name), index=i, loc=cloc, default_loc=value.loc)
            for i, (cname, value, cloc) in enumerate(comps)
        )
        group = ir.HyperGroup(str(name), tuple(m.name for m in members), interval, loc=_token_loc(self.path, name))
        return (group, members)

    @v_args(meta=True)
    def flag(self, meta, children):
        name, expr = children
        loc = _token_loc(self.path, name)
        if isinstance(expr, ir.BoolLit):
            return ir.Flag(str(name), expr.value, loc=loc)
        return ir.DerivedFlag(str(name), expr, loc=loc)

    @v_args(meta=True)
    def choice(self, meta, children):
        name, default, *values = children
        words = []
        for tok in values:
            word = self._word(tok)
            if word in words:
                raise SpecError(f"the word \"{word}\" is listed twice", _token_loc(self.path, tok), self.source)
            words.append(word)
        if default.type == "NONE":
            return ir.Choice(str(name), None, tuple(words), loc=_token_loc(self.path, name))
        word = self._word(default)
        if word not in words:
            raise SpecError(f"the default \"{word}\" of '{name}' is not one of its words "
                            + ", ".join(f'"{w}"' for w in words), _token_loc(self.path, default), self.source,
                            hint="list it after 'in', or make the default 'none'")
        return ir.Choice(str(name), word, tuple(words), loc=_token_loc(self.path, name))

    def _word(self, tok: Token) -> str:
        """A choice's word: the quoted text of `tok`, which must be an identifier (it names a keyword's value,
        and `forge-gen` may print it)."""
        word = tok.value[1:-1]
        if not _WORD.fullmatch(word):
            raise SpecError(f"the word \"{word}\" must be an identifier (letters, digits and '_', not starting "
                            "with a digit)", _token_loc(self.path, tok), self.source)
        return word

    @v_args(meta=True)
    def state(self, meta, children):
        name, rest = children[0], list(children[1:])
        extent = rest.pop(0) if isinstance(rest[0], _Extent) else None
        init = rest[0]
        modifiers = [c for c in rest[1:] if isinstance(c, Token) and c.type in ("NONNEG", "EXACT")]
        conds = [c for c in rest[1:] if not (isinstance(c, Token) and c.type in ("NONNEG", "EXACT"))]
        seen: set[str] = set()
        for tok in modifiers:
            if tok.value in seen:
                raise SpecError(f"'{tok.value}' is written twice", _token_loc(self.path, tok), self.source)
            seen.add(tok.value)
        return ir.State(str(name), init, "nonneg" in seen, conds[0] if conds else None, exact="exact" in seen,
                        loc=_token_loc(self.path, name), extent=None if extent is None else extent.name)

    def extent(self, children):
        (tok,) = children
        if tok.value not in STATE_EXTENTS:
            raise SpecError(f"a state is one value per element, per row ([rows]) or per column ([cols]) of the "
                            f"weight, not per '{tok.value}'", _token_loc(self.path, tok), self.source,
                            hint="write 'state NAME[rows] = 0' or 'state NAME[cols] = 0'")
        return _Extent(str(tok.value))

    @v_args(meta=True)
    def scalar(self, meta, children):
        name, init = children
        return ir.ScalarState(str(name), init, loc=_token_loc(self.path, name))

    @v_args(meta=True)
    def require(self, meta, children):
        cond, message = children
        return ir.Require(cond, message.value[1:-1], loc=self._loc(meta))

    # -- statements --------------------------------------------------------
    @v_args(meta=True)
    def assign(self, meta, children):
        name, value = children
        return ir.Assign(str(name), value, loc=self._loc(meta), target_loc=_token_loc(self.path, name))

    @v_args(meta=True)
    def if_stmt(self, meta, children):
        cond, rest = children[0], children[1:]
        orelse: tuple = ()
        if rest and isinstance(rest[-1], tuple) and rest[-1][:1] == ("else",):
            orelse = rest[-1][1]
            rest = rest[:-1]
        return ir.If(cond, tuple(rest), orelse, loc=self._loc(meta))

    def else_part(self, children):
        return ("else", tuple(children))

    def else_if(self, children):
        return ("else", (children[0],))

    def update_block(self, children):
        return ("update", tuple(children))

    # -- expressions -------------------------------------------------------
    @v_args(meta=True)
    def number(self, meta, children):
        return ir.Num(self._number(children[0]), loc=self._loc(meta))

    @v_args(meta=True)
    def true(self, meta, children):
        return ir.BoolLit(True, loc=self._loc(meta))

    @v_args(meta=True)
    def false(self, meta, children):
        return ir.BoolLit(False, loc=self._loc(meta))

    @v_args(meta=True)
    def inf(self, meta, children):
        return ir.Num(math.inf, loc=self._loc(meta))

    @v_args(meta=True)
    def name(self, meta, children):
        return ir.Name(str(children[0]), loc=self._loc(meta))

    @v_args(meta=True)
    def call(self, meta, children):
        func = children[0]
        args = tuple(c for c in children[1:] if c is not None)
        return ir.Call(str(func), args, loc=self._loc(meta), func_loc=_token_loc(self.path, func))

    @v_args(meta=True)
    def index(self, meta, children):
        return ir.Index(children[0], tuple(children[1:]), loc=self._loc(meta))

    @v_args(meta=True)
    def method(self, meta, children):
        args = tuple(c for c in children[2:] if c is not None)
        return ir.Method(children[0], str(children[1]), args, loc=self._loc(meta))

    @v_args(meta=True)
    def given(self, meta, children):
        return ir.Given(str(children[0]), loc=self._loc(meta))

    @v_args(meta=True)
    def attribute(self, meta, children):
        return ir.Attribute(children[0], str(children[1]), loc=self._loc(meta))

    @v_args(meta=True)
    def neg(self, meta, children):
        return ir.Unary("neg", children[0], loc=self._loc(meta))

    @v_args(meta=True)
    def not_(self, meta, children):
        return ir.Unary("not", children[0], loc=self._loc(meta))

    def _binary(op):
        @v_args(meta=True)
        def method(self, meta, children):
            return ir.Binary(op, children[0], children[1], loc=self._loc(meta))

        return method

    add = _binary("add")
    sub = _binary("sub")
    mul = _binary("mul")
    div = _binary("div")
    pow = _binary("pow")
    and_ = _binary("and")
    or_ = _binary("or")
    del _binary

    @v_args(meta=True)
    def text(self, meta, children):
        return ir.Text(self._word(children[0]), loc=self._loc(meta))

    @v_args(meta=True)
    def compare(self, meta, children):
        left, op, right = children
        return ir.Binary(ir.COMPARE_SYMBOLS[op.value], left, right, loc=self._loc(meta))

    # -- the whole spec ----------------------------------------------------
    @v_args(meta=True)
    def start(self, meta, children):
        _, name, doc, name_loc = children[0]
        hypers, groups, flags, derived, states, scalars, requires, choices = [], [], [], [], [], [], [], []
        body: tuple = ()
        for item in children[1:]:
            if isinstance(item, ir.Hyper):
                hypers.append(item)
            elif isinstance(item, tuple) and item and isinstance(item[0], ir.HyperGroup):
                groups.append(item[0])
                hypers.extend(item[1])
            elif isinstance(item, ir.Flag):
                flags.append(item)
            elif isinstance(item, ir.DerivedFlag):
                derived.append(item)
            elif isinstance(item, ir.Choice):
                choices.append(item)
            elif isinstance(item, ir.State):
                states.append(item)
            elif isinstance(item, ir.ScalarState):
                scalars.append(item)
            elif isinstance(item, ir.Require):
                requires.append(item)
            elif isinstance(item, tuple) and item[:1] == ("update",):
                body = item[1]
        return ir.Spec(
            name=name,
            doc=doc,
            hypers=tuple(hypers),
            groups=tuple(groups),
            flags=tuple(flags),
            derived=tuple(derived),
            states=tuple(states),
            scalars=tuple(scalars),
            requires=tuple(requires),
            body=body,
            choices=tuple(choices),
            path=self.path,
            source=self.source,
            loc=name_loc,
        )


def parse_spec(source: str, path: str = "<string>") -> ir.Spec:
    """Parse `.fopt` text into an (unchecked) `ir.Spec`.

    Raises:
        SpecError: on any syntax error, located at the offending token; on a line break only editors see or a
            bidirectional-text control anywhere (`errors.HIDING_CHARACTERS`); on a number literal that is not
            a float (too large, or nonzero digits that underflow to 0).
    """
    hiding = _HIDING.search(source)
    if hiding is not None:
        raise _hiding_character_error(path, source, hiding.start())
    try:
        tree = _parser().parse(source)
    except lark.exceptions.UnexpectedInput as err:
        raise _syntax_error(err, path, source) from None
    except RecursionError:
        raise _too_deep(path, source) from None
    depth, deepest = _tree_depth(tree)
    if depth > MAX_DEPTH:
        raise _too_deep(path, source, deepest)
    try:
        return _ToIR(path, source).transform(tree)
    except lark.exceptions.VisitError as err:
        if isinstance(err.orig_exc, SpecError):
            raise err.orig_exc from None
        if isinstance(err.orig_exc, RecursionError):
            raise _too_deep(path, source) from None
        raise
    except RecursionError:
        raise _too_deep(path, source) from None
