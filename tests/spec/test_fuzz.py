"""Fuzzing the compiler: any text either raises SpecError, or loads, renders, compiles and its kernel
matches its float64 reference step.

A text that loads (`check_spec`) must also render (`codegen.render_module`), and the module must
compile as Python: nothing else may escape.  The kernel tests go on: the module is loaded as the
runtime loads it (`kernels.compiled.compiled_module`, into a cache folder of the test's own), and its
element-wise kernel runs a few steps on a small random problem with hyperparameters inside their
ranges, each step compared with `forge_dsl.reference_step` in float64 within a per-element bound
that follows the program's conditioning (tests/helpers/fuzz_kernels.py says how).

Two generators: (a) random text, from printable characters and from a token-ish
alphabet of the language's keywords, operators and names; (b) the shipped specs
in optimizers/*.fopt, mutated by deleting, duplicating, swapping or inserting
characters and tokens, or by replacing names, numbers and operators with others
of their kind (so that most mutants parse and the checker is exercised).
Inputs that once crashed the front end, or whose kernel once missed its reference, are kept as
regression cases at the end.

FORGE_FUZZ_EXAMPLES sets the front-end tests' examples (default 300: the file runs in about 35 s),
FORGE_FUZZ_KERNEL_EXAMPLES the kernel tests' (default a tenth of it); FORGE_FUZZ_STATS=FILE writes
how many texts loaded and how many kernels were checked there as JSON.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import re
import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from forge_dsl.compiler import codegen
from forge_dsl.spec.checker import check_spec
from forge_dsl.compiler.codegen import render_module
from forge_dsl.spec.errors import SpecError
from forge_dsl.compiler import loader as compiled
from forge_dsl.spec.parser import parse_spec
from forge_dsl.spec.phases import is_phased, plan

from fuzz_kernels import KernelMismatch, check_kernel, forget_module
from repo import ROOT

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

# Examples are small; the whole file runs in about 35 seconds.  Set
# FORGE_FUZZ_EXAMPLES=5000 for a longer hunt (the kernel tests then run 333 each).
# The random corpora (every @given test) are in the slow tier (`pytest -m slow`); the seeded mutants, the
# ill-conditioned specs and the former crashes are in the quick one.
EXAMPLES = int(os.environ.get("FORGE_FUZZ_EXAMPLES", "300"))
FAST = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# A kernel check costs 0.1-0.2 s (three steps in the interpreter, one program each).
KERNEL = settings(
    max_examples=int(os.environ.get("FORGE_FUZZ_KERNEL_EXAMPLES", str(max(1, EXAMPLES // 15)))),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TRIES = 10  # texts drawn per kernel example, the first that loads checked
_KERNEL_CHECKED: set = set()  # the specs whose kernels passed (a failing one is checked again as it shrinks)
STATS = collections.Counter()  # texts, loaded, kernel_tried/_skipped/_matched, elements, certain, special
# A long hunt: FORGE_FUZZ_FAILURES=FILE records every failure there (JSON lines: text, seed, error) and goes
# on, instead of stopping at the first.
FAILURES = os.environ.get("FORGE_FUZZ_FAILURES")


def _recording(check):
    """`check(text, ...)`, with its failures written to FORGE_FUZZ_FAILURES instead of raised when it is set."""
    @functools.wraps(check)
    def run(text, *args):
        if not FAILURES:
            return check(text, *args)
        try:
            return check(text, *args)
        except Exception as err:  # noqa: BLE001 - recorded for the report, the hunt goes on
            STATS["failures"] += 1
            with open(FAILURES, "a") as f:
                f.write(json.dumps({"text": text, "args": list(args), "error": f"{type(err).__name__}: {err}"}) + "\n")
            return None
    return run


@pytest.fixture(scope="module", autouse=True)
def _own_cache(tmp_path_factory):
    """Compiled fuzz modules go to a cache folder of this module's own, not the user's; the counts to
    FORGE_FUZZ_STATS when it is set."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FORGE_DSL_CACHE", str(tmp_path_factory.mktemp("forge_dsl_cache")))
        yield
    if os.environ.get("FORGE_FUZZ_STATS"):
        Path(os.environ["FORGE_FUZZ_STATS"]).write_text(json.dumps(dict(STATS), indent=1, sort_keys=True) + "\n")


@_recording
def load_spec_or_spec_error(text: str):
    """Parse and check `text`: the spec, or None where it raised SpecError (which must render).  A spec
    that loads must render into a module that compiles; nothing else may escape."""
    STATS["texts"] += 1
    try:
        spec = check_spec(parse_spec(text, "fuzz.fopt"))
        modules = plan(spec).phases if is_phased(spec) else (spec,)  # a spec in phases: a module per phase
    except SpecError as err:
        assert str(err).startswith("fuzz.fopt:") or not err.loc
        return None
    STATS["loaded"] += 1
    for module in modules:
        _render_and_compile(module)
    return spec


def load_or_spec_error(text: str) -> None:
    load_spec_or_spec_error(text)


@functools.lru_cache(maxsize=4096)
def _render_and_compile(spec) -> None:
    # Cached by the spec (IR equality ignores layout): most loading mutants are one of a few specs.
    compile(render_module(spec), "fuzz.py", "exec")


def load_first_and_check_kernel(texts, seed: int) -> None:
    """`load_spec_or_spec_error` on each text until one loads, then its kernel against its float64
    reference (`fuzz_kernels.check_kernel`; each distinct spec once)."""
    for text in texts:
        spec = load_spec_or_spec_error(text)
        if spec is not None and not is_phased(spec):  # the kernel check runs one element-wise kernel
            break
    else:
        return
    if spec not in _KERNEL_CHECKED:
        _recording(lambda _text, seed: check_kernel_counted(spec, seed))(text, seed)


def check_kernel_counted(spec, seed: int) -> None:
    STATS["kernel_tried"] += 1
    try:
        outcome = check_kernel(spec, seed)
    finally:
        forget_module(spec)
    _KERNEL_CHECKED.add(spec)
    if not outcome.checked:
        STATS["kernel_skipped"] += 1  # no flag combination whose requires can be met
        return
    STATS["kernel_matched"] += 1  # check_kernel raises on a mismatch
    STATS["elements"] += outcome.elements
    STATS["certain"] += outcome.certain
    STATS["special"] += outcome.special


# (a) random text ------------------------------------------------------------

@pytest.mark.slow
@FAST
@given(st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x2FFF), max_size=200))
def test_random_characters(text):
    load_or_spec_error(text)


@pytest.mark.slow
@FAST
@given(st.text(alphabet=string.printable, max_size=200))
def test_random_printable_ascii(text):
    load_or_spec_error(text)


@pytest.mark.slow
@FAST
@given(st.lists(st.sampled_from(TOKENS), max_size=60))
def test_random_tokens(tokens):
    load_or_spec_error(" ".join(tokens))


@pytest.mark.slow
@FAST
@given(st.lists(st.sampled_from(TOKENS), max_size=40))
def test_random_tokens_after_a_valid_header(tokens):
    # Past the header, so that the random part reaches declarations and the update.
    load_or_spec_error("optimizer fuzz\nhyper lr = 1e-3\n" + " ".join(tokens))


@pytest.mark.slow
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
            odd = ["\x00", "é", "\t", "\x1b", "\u2028", "\u202e", "\u0430", "\u2212", "\xa0"]
            c = data.draw(st.sampled_from(list("(){}[]=+-*/<>.,#\"\n _0a\\") + odd))
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
NUMBERS = ["0", "1", "2", "0.5", "1e-3", "1e999", "1e-400", "1e-50", "inf"]


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


@pytest.mark.slow
@FAST
@given(st.sampled_from(sorted(SPECS)), st.data())
def test_mutated_specs_same_class(name, data):
    load_or_spec_error(_mutate_same_class(SPECS[name], data))


@pytest.mark.slow
@FAST
@given(st.sampled_from(sorted(SPECS)), st.data())
def test_mutated_specs_characters(name, data):
    load_or_spec_error(_mutate_chars(SPECS[name], data))


@pytest.mark.slow
@FAST
@given(st.sampled_from(sorted(SPECS)), st.data())
def test_mutated_specs_tokens(name, data):
    load_or_spec_error(_mutate_tokens(SPECS[name], data))


# (c) the kernels of what loads ----------------------------------------------

SEEDS = st.integers(0, 2**31 - 1)
KERNEL_TEST = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy on NaN and inf in the interpreter
UNARY_FUNCTIONS = ["sqrt", "rsqrt", "abs", "sign", "exp", "log", "tanh", "erf", "atan", "log1p", "expm1"]
BINARY_FUNCTIONS = ["min", "max", "atan2"]
ARITHMETIC = ["+", "-", "*", "/", "**"]
COMPARISONS = ["<", "<=", ">", ">=", "==", "!="]
SPEC_NUMBERS = ["0", "1", "2", "3", "0.5", "0.9", "0.999", "1e-3", "1e-8", "10", "100", "1e30", "1e-30", "inf"]


def _mutate_meaning(text: str, data) -> str:
    """Change what a spec computes while keeping it likely to load: operators, functions and numbers
    replaced by others of their kind, names by other names of the spec, or wrapped in a function, negated,
    or combined with another operand."""
    tokens = TOKEN_RE.findall(text)
    words = set(KEYWORDS) | set(UNARY_FUNCTIONS) | set(BINARY_FUNCTIONS) | {"clamp", "where", "given"}
    names = sorted({t for t in tokens if t.isidentifier() and t not in words}) or ["grad"]
    body = tokens.index("update") if "update" in tokens else 0
    spots = [i for i, t in enumerate(tokens) if t in ARITHMETIC or t in COMPARISONS or t in words - set(KEYWORDS)
             or t[0].isdigit() or (i > body and t in names)]
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.sampled_from(spots))
        t = tokens[i]
        for kind in (ARITHMETIC, COMPARISONS, UNARY_FUNCTIONS, BINARY_FUNCTIONS):
            if t in kind:
                tokens[i] = data.draw(st.sampled_from(kind))
                break
        else:
            if t[0].isdigit():
                tokens[i] = data.draw(st.sampled_from(SPEC_NUMBERS))
            elif t in names:
                how = data.draw(st.sampled_from(["rename", "wrap", "negate", "combine"]))
                other = data.draw(st.sampled_from(names + SPEC_NUMBERS))
                tokens[i] = {"rename": other, "wrap": f"{data.draw(st.sampled_from(UNARY_FUNCTIONS))}({t})",
                             "negate": f"(-{t})",
                             "combine": f"({t} {data.draw(st.sampled_from(ARITHMETIC))} {other})"}[how]
    return "".join(tokens)


# The specs whose mutants the kernel tests compile: those that run as one element-wise kernel (a spec in phases,
# spec/phases.py, is compiled phase by phase; its mutants are still checked by the tests above).
KERNEL_SPECS = sorted(name for name, text in SPECS.items() if not is_phased(check_spec(parse_spec(text, name))))


def _mutants(mutate, name: str, data):
    return (mutate(SPECS[name], data) for _ in range(TRIES))


@pytest.mark.parametrize("mutate", [_mutate_meaning, _mutate_same_class, _mutate_chars, _mutate_tokens],
                         ids=["in_meaning", "same_class", "characters", "tokens"])
@pytest.mark.slow
@KERNEL_TEST
@KERNEL
@given(st.sampled_from(KERNEL_SPECS), st.data(), SEEDS)
def test_kernels_of_mutated_specs(mutate, name, data, seed):
    load_first_and_check_kernel(_mutants(mutate, name, data), seed)


@pytest.mark.slow
@KERNEL_TEST
@KERNEL
@given(st.data(), SEEDS)
def test_kernels_of_random_tokens_inside_update(data, seed):
    head = "optimizer fuzz\nhyper lr = 1e-3 in [0, inf)\nflag amsgrad = false\nstate m = 0\nupdate {\n    m = grad\n    "
    tail = "\n    param = param - lr * m\n}\n"
    texts = (head + " ".join(data.draw(st.lists(st.sampled_from(TOKENS), max_size=30))) + tail for _ in range(TRIES))
    load_first_and_check_kernel(texts, seed)


@KERNEL_TEST
@pytest.mark.parametrize("name", KERNEL_SPECS)
def test_kernels_of_the_specs_mutated_from(name):
    # The committed module of a built-in (forge_dsl/generated/), compiled into the cache for idioms.
    spec = check_spec(parse_spec(SPECS[name], "fuzz.fopt"))
    try:
        for seed in range(2):
            outcome = check_kernel(spec, seed)
            # well-conditioned: every element has a finite bound, so the check is not vacuous
            assert outcome.checked and outcome.certain == outcome.elements > 0
    finally:
        forget_module(spec)


# NaN, infinities, fp32's range, cancellation, poles: what fuzzed specs reach, written on purpose.
ILL_CONDITIONED = [
    "sqrt(grad)", "1 / (grad * 1e-20 * 1e-20)", "exp(grad * 1000)", "(grad - grad * 1.0000001) * 1e7",
    "where(grad * 1e30 * 1e30 > 1e38, grad, param)", "sign(param - param * 1.0000001)", "grad ** param",
    "atan2(grad, param - param)", "log(abs(grad) ** 100)", "1e38 * 10 * grad", "tanh(grad) - grad",
    "log1p(grad * 1e30) / (param - param)", "min(grad / 0, param * inf)", "expm1(1 / grad) ** 0.5",
]


@KERNEL_TEST
@pytest.mark.parametrize("expr", ILL_CONDITIONED)
def test_kernels_of_ill_conditioned_specs(expr):
    text = (f"optimizer ill\nhyper lr = 1e-3 in [0, inf)\nstate q = 0\n"
            f"update {{\n    param = {expr}\n    q = q + lr\n}}\n")
    spec = check_spec(parse_spec(text, "fuzz.fopt"))
    try:
        for seed in range(2):
            outcome = check_kernel(spec, seed)
            assert outcome.checked and outcome.certain > 0
    finally:
        forget_module(spec)


@KERNEL_TEST
@pytest.mark.parametrize("name", KERNEL_SPECS)
def test_the_kernel_check_catches_a_misspelled_operation(name, monkeypatch, tmp_path):
    """With the code generator spelling every per-element `-` as `+`, the check fails on every spec."""
    spelled = codegen._elem_expr

    def misspelled(instr, bool_exports):
        return spelled(dataclasses.replace(instr, op="add") if instr.op == "sub" else instr, bool_exports)

    monkeypatch.setattr(codegen, "_elem_expr", misspelled)
    monkeypatch.setenv("FORGE_DSL_CACHE", str(tmp_path))  # nothing compiled here outlives the test
    compiled._compiled.cache_clear()
    # a comment changes the text's hash, so the committed module of a built-in is not the one that runs
    spec = check_spec(parse_spec(SPECS[name] + "\n# misspelled\n", "fuzz.fopt"))
    try:
        with pytest.raises(KernelMismatch, match="outside the bound"):
            check_kernel(spec, seed=0)
    finally:
        forget_module(spec)
        compiled._compiled.cache_clear()


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
    # str.splitlines() also splits at form feeds and U+001C (and U+2028, which a spec may not hold); the parser
    # counts '\n' only.
    text = "optimizer c # \x1c \x0c\nhyper lr = 1\x0c\nupdate {\n    param = param - lr * grd\n}\n"
    with pytest.raises(SpecError) as info:
        check_spec(parse_spec(text, "odd.fopt"))
    assert str(info.value).split("\n")[1] == "        param = param - lr * grd"
