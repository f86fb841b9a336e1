"""Fuzzing the front end: any text either raises SpecError, or loads, renders and compiles.

A text that loads (`check_spec`) must also render (`codegen.render_module`), and
the module must compile as Python: nothing else may escape.

Two generators: (a) random text, from printable characters and from a token-ish
alphabet of the language's keywords, operators and names; (b) the shipped specs
in optimizers/*.fopt, mutated by deleting, duplicating, swapping or inserting
characters and tokens, or by replacing names, numbers and operators with others
of their kind (so that most mutants parse and the checker is exercised).
Inputs that once crashed the front end are kept as regression cases at the end.
"""

from __future__ import annotations

import functools
import os
import re
import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forge_dsl.checker import check_spec
from forge_dsl.codegen import render_module
from forge_dsl.errors import SpecError
from forge_dsl.parser import parse_spec

ROOT = Path(__file__).resolve().parent.parent
SPECS = {p.name: p.read_text() for p in sorted((ROOT / "optimizers").glob("*.fopt"))}
# Specs in the newer syntax (states from param, exact, optional hyperparameters, the newer
# functions, the moving averages the nonneg proof knows), so that mutants exercise it too.
SPECS["idioms.fopt"] = """\
optimizer idioms "states from the weights; an optional ramp"
hyper lr = 1e-3 in [0, inf)
hyper betas = (beta1 = 0.9, beta2 = 0.999) in [0, 1)
hyper t_warm = none in [1, inf)
flag has_warm = given(t_warm)
flag maximize = false
require given(t_warm) or lr < 1, "lr must be below 1 without t_warm"
state z = param
state x0 = -param exact
state v = 0 nonneg
state y = 0 nonneg exact
update {
    g = where(maximize, -grad, grad)
    v = v + (1 - beta2) * (g * g - v)
    y = y - (1 - beta1) * sign(y - g * g) * g * g
    if has_warm {
        ramp = min(step / t_warm, 1)
    } else {
        ramp = 1
    }
    z = z - lr * ramp * tanh(g) / (sqrt(v) + atan(1e-8) + erf(1))
    param = z + x0 * expm1(log1p(beta1)) + atan2(beta1, beta2) * 0
    x0 = x0 + 0 * y
}
"""

KEYWORDS = [
    "optimizer", "hyper", "flag", "state", "scalar", "require", "update", "nonneg", "exact", "none", "given",
    "in", "if", "else", "and", "or", "not", "true", "false", "inf",
]
OPERATORS = ["=", "==", "!=", "<", "<=", ">", ">=", "+", "-", "*", "/", "**", "(", ")", "[", "]", "{", "}", ",", "."]
NAMES = [
    "param", "grad", "step", "lr", "beta1", "beta2", "betas", "eps", "m", "v", "g", "x", "amsgrad", "maximize",
    "sqrt", "rsqrt", "abs", "sign", "exp", "log", "min", "max", "clamp", "where", "sum", "norm", "lambda", "tl",
    "_x", "a__b", "spec", "atan", "atan2", "tanh", "erf", "log1p", "expm1", "t_warm", "has_warm", "z", "tf32",
    "mean", ".norm()", ".mean(0)", "given(t_warm)",
]
LITERALS = ["0", "1", "0.9", "1e-8", "2", ".5", "1e999", '"doc"', '"a\x00b"', '"\\"', "# comment\n", "\n", " ",
            "\t", "\x00"]
TOKENS = KEYWORDS + OPERATORS + NAMES + LITERALS

# Examples are small; the whole file runs in about ten seconds.  Set
# FORGE_FUZZ_EXAMPLES=5000 for a longer hunt.
FAST = settings(
    max_examples=int(os.environ.get("FORGE_FUZZ_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def load_or_spec_error(text: str) -> None:
    """Parse and check `text`; only SpecError may escape (and it must render).  A spec that
    loads must render into a module that compiles."""
    try:
        spec = check_spec(parse_spec(text, "fuzz.fopt"))
    except SpecError as err:
        assert str(err).startswith("fuzz.fopt:") or not err.loc
        return
    _render_and_compile(spec)


@functools.lru_cache(maxsize=4096)
def _render_and_compile(spec) -> None:
    # Cached by the spec (IR equality ignores layout): most loading mutants are one of a few specs.
    compile(render_module(spec), "fuzz.py", "exec")


# (a) random text ------------------------------------------------------------

@FAST
@given(st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x2FFF), max_size=200))
def test_random_characters(text):
    load_or_spec_error(text)


@FAST
@given(st.text(alphabet=string.printable, max_size=200))
def test_random_printable_ascii(text):
    load_or_spec_error(text)


@FAST
@given(st.lists(st.sampled_from(TOKENS), max_size=60))
def test_random_tokens(tokens):
    load_or_spec_error(" ".join(tokens))


@FAST
@given(st.lists(st.sampled_from(TOKENS), max_size=40))
def test_random_tokens_after_a_valid_header(tokens):
    # Past the header, so that the random part reaches declarations and the update.
    load_or_spec_error("optimizer fuzz\nhyper lr = 1e-3\n" + " ".join(tokens))


@FAST
@given(st.lists(st.sampled_from(TOKENS), max_size=30))
def test_random_tokens_inside_update(tokens):
    load_or_spec_error(
        "optimizer fuzz\nhyper lr = 1e-3 in [0, inf)\nflag amsgrad = false\nstate m = 0\n"
        "update {\n    m = grad\n    " + " ".join(tokens) + "\n    param = param - lr * m\n}\n"
    )


# (b) mutated valid specs ----------------------------------------------------

TOKEN_RE = re.compile(r'"[^"\n]*"|#[^\n]*|\*\*|[<>=!]=|[A-Za-z_][A-Za-z0-9_]*|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\s+|.')


def _mutate_chars(text: str, data) -> str:
    for _ in range(data.draw(st.integers(1, 4))):
        if not text:
            break
        i = data.draw(st.integers(0, len(text) - 1))
        j = data.draw(st.integers(0, len(text) - 1))
        kind = data.draw(st.sampled_from(["delete", "duplicate", "swap", "insert"]))
        if kind == "delete":
            text = text[:i] + text[i + 1:]
        elif kind == "duplicate":
            text = text[:i] + text[i] + text[i:]
        elif kind == "swap":
            chars = list(text)
            chars[i], chars[j] = chars[j], chars[i]
            text = "".join(chars)
        else:
            c = data.draw(st.sampled_from(list("(){}[]=+-*/<>.,#\"\n _0a\\") + ["\x00", "é", "\t", "\x1b", "\u2028"]))
            text = text[:i] + c + text[i:]
    return text


def _mutate_tokens(text: str, data) -> str:
    tokens = TOKEN_RE.findall(text)
    for _ in range(data.draw(st.integers(1, 4))):
        if not tokens:
            break
        i = data.draw(st.integers(0, len(tokens) - 1))
        j = data.draw(st.integers(0, len(tokens) - 1))
        kind = data.draw(st.sampled_from(["delete", "duplicate", "swap", "insert", "replace"]))
        if kind == "delete":
            del tokens[i]
        elif kind == "duplicate":
            tokens.insert(i, tokens[i])
        elif kind == "swap":
            tokens[i], tokens[j] = tokens[j], tokens[i]
        else:
            new = data.draw(st.sampled_from(TOKENS))
            if kind == "insert":
                tokens.insert(i, " " + new + " ")
            else:
                tokens[i] = new
    return "".join(tokens)


BINARY_OPERATORS = ["+", "-", "*", "/", "**", "==", "!=", "<", "<=", ">", ">=", "and", "or"]
NAME_LIKE = NAMES + ["true", "false", "inf", "not", "none", "exact", "nonneg", "param"]
NUMBERS = ["0", "1", "2", "0.5", "1e-3", "1e999", "inf"]


def _mutate_same_class(text: str, data) -> str:
    """Replace names by names, numbers by numbers and operators by operators: mostly
    still parses, so the checker is what gets exercised."""
    tokens = TOKEN_RE.findall(text)
    spots = [i for i, t in enumerate(tokens) if t in BINARY_OPERATORS or t[0].isalnum() or t[0] == "_"]
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.sampled_from(spots))
        t = tokens[i]
        if t in BINARY_OPERATORS:
            tokens[i] = data.draw(st.sampled_from(BINARY_OPERATORS))
        elif t[0].isdigit():
            tokens[i] = data.draw(st.sampled_from(NUMBERS))
        else:
            tokens[i] = data.draw(st.sampled_from(NAME_LIKE + [t + "_"]))
    return "".join(tokens)


@FAST
@given(st.sampled_from(sorted(SPECS)), st.data())
def test_mutated_specs_same_class(name, data):
    load_or_spec_error(_mutate_same_class(SPECS[name], data))


@FAST
@given(st.sampled_from(sorted(SPECS)), st.data())
def test_mutated_specs_characters(name, data):
    load_or_spec_error(_mutate_chars(SPECS[name], data))


@FAST
@given(st.sampled_from(sorted(SPECS)), st.data())
def test_mutated_specs_tokens(name, data):
    load_or_spec_error(_mutate_tokens(SPECS[name], data))


def test_deep_nesting_is_a_spec_error():
    head = "optimizer deep\nhyper lr = 1e-3\nupdate {\n    param = param - lr * "
    for body in ["-" * 3000 + "grad", "grad" + " ** grad" * 3000, "(" * 3000 + "grad" + ")" * 3000,
                 "grad" + " + grad" * 3000, "sqrt(" * 3000 + "grad" + ")" * 3000]:
        load_or_spec_error(head + body + "\n}\n")


# Inputs that once crashed the front end with something other than SpecError.
REGRESSIONS = {
    # a compile-time condition made of constants reached eval_static, which knew only flags
    "constant_if": "optimizer c\nhyper lr = 1\nupdate {\n    if 1 < 2 { param = param - lr * grad }\n}\n",
    "constant_where_in_state_condition": (
        "optimizer c\nhyper lr = 1\nstate m = 0 if where(true, false, true)\n"
        "update {\n    m = grad\n    param = param - lr * m\n}\n"
    ),
    # deep unary / power chains overflowed the recursion of the tree transformer
    "deep_unary": "optimizer c\nhyper lr = 1\nupdate {\n    param = param - lr * " + "-" * 1500 + "grad\n}\n",
    "deep_power": "optimizer c\nhyper lr = 1\nupdate {\n    param = grad" + " ** grad" * 1500 + "\n}\n",
}


@pytest.mark.parametrize("name", sorted(REGRESSIONS))
def test_former_crashes(name):
    load_or_spec_error(REGRESSIONS[name])


def test_odd_line_breaks_quote_the_right_line():
    # str.splitlines() also splits at form feeds and U+2028; the parser counts '\n' only.
    text = "optimizer c # \u2028 \x0c\nhyper lr = 1\x0c\nupdate {\n    param = param - lr * grd\n}\n"
    with pytest.raises(SpecError) as info:
        check_spec(parse_spec(text, "odd.fopt"))
    assert str(info.value).split("\n")[1] == "        param = param - lr * grd"
