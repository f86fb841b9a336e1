"""Front-end cases that load (so the error corpus cannot hold them) or that need more than a message.

The `nonneg` interval proof (sound with NaN, the moving averages and bias
corrections it knows), long chains of temporaries, strings, and the IR of the
idioms: states that start from the weights, exact states, optional
hyperparameters. Then characters: those that hide code (refused anywhere) and
those pasted from elsewhere (named, with a hint), number literals that are not
floats, and defaults that leave their range in fp32.
"""

from __future__ import annotations


import pytest

from forge_dsl.spec import ir
from forge_dsl.spec.checker import check_spec
from forge_dsl.spec.keywords import resolve_hypers
from forge_dsl.spec.errors import SpecError
from forge_dsl.compiler.lowering import lower_all
from forge_dsl.spec.parser import parse_spec


def load(text: str) -> ir.Spec:
    return check_spec(parse_spec(text, "t.fopt"))


def nonneg_spec(value: str, decls: str = "") -> str:
    uses = "".join(f" * {line.split()[1]}" for line in decls.split("\n") if line.startswith("hyper"))
    return (f"optimizer t\nhyper lr = 1e-3 in [0, inf)\n{decls}\nstate v = 0 nonneg\n"
            f"update {{\n    v = {value}\n    param = param - lr * grad * v{uses}\n}}\n")


# -- the nonneg proof: NaN, zeros, infinities --------------------------------

UNSOUND = [
    "min(grad + inf, -1)",          # inf + -inf is NaN in bound arithmetic
    "min(-1, grad + inf)",          # ... whichever side it is on
    "max(sqrt(grad), -1)",          # sqrt(<0) is NaN, and fmax(NaN, -1) is -1
    "clamp(sqrt(grad), -1, 2)",
    "1 / (grad * 0)",               # grad * 0 may be -0.0: 1 / -0.0 is -inf
    "1 / -0",
    "rsqrt(-0)",                    # rsqrt(-0.0) is -inf
    "rsqrt(v)",
    "(-0) ** -1",                   # (-0.0) ** -1 is -inf
    "v ** -1",
    "v ** grad",
    "grad ** 3",
    "(inf * grad) * 0 - 1",
    "log(v)",
    "sign(v) - 0.5",
    "exp(grad) - 1e-300",
]


@pytest.mark.parametrize("value", UNSOUND)
def test_nonneg_is_refused_where_a_value_can_be_negative(value):
    with pytest.raises(SpecError, match="declared nonneg, but this value can be negative"):
        load(nonneg_spec(value))


SOUND = [
    "grad * grad",
    "v + grad ** 2",
    "(grad - v) ** -2",
    "max(grad, 0)",
    "max(sqrt(grad), 0)",
    "exp(grad)",
    "abs(grad) / (v + 1)",
    "sqrt(v) * 2",
    "min(v, abs(grad))",
    "where(grad > 0, v, grad * grad)",
]


@pytest.mark.parametrize("value", SOUND)
def test_nonneg_is_proven(value):
    load(nonneg_spec(value))


BETA = "hyper b = 0.99 in [0, 1)\nhyper c = 0.5 in [0, 1]"
AVERAGES = [
    "v + (1 - b) * (grad * grad - v)",          # torch's lerp
    "v + (grad * grad - v) * (1 - b)",
    "(1 - b) * (grad * grad - v) + v",
    "v + c * (1 - b) * (abs(grad) - v)",        # a product of weights
    "v - (1 - b) * (v - grad * grad)",
    "(1 - c) * v + c * grad * grad",
    "v - (1 - b) * sign(v - grad * grad) * grad * grad",   # Yogi
    "v + (1 - b) * sign(grad * grad - v) * grad * grad",
    "v + (grad * grad - v)",
]


@pytest.mark.parametrize("value", AVERAGES)
def test_moving_averages_are_proven(value):
    load(nonneg_spec(value, BETA))


NOT_AVERAGES = [
    ("v + b * (grad - v)", "'grad' can be negative"),
    ("v + (1 + b) * (grad * grad - v)", "weight is in [0, 1]; '1 + b' is in [1, 2]"),
    ("v - (1 - b) * (grad * grad - v)", None),                   # the wrong sign
    ("v - (1 - b) * sign(v - grad * grad) * grad", None),        # x's factors are missing
    ("v - (1 - b) * sign(v - grad * grad) * grad * grad * 2", "weight is in [0, 1]"),
    ("grad + (1 - b) * (v - grad)", "'grad' can be negative"),
]


@pytest.mark.parametrize("value,hint", NOT_AVERAGES)
def test_not_quite_moving_averages_are_refused(value, hint):
    with pytest.raises(SpecError) as info:
        load(nonneg_spec(value, BETA))
    if hint is not None:
        assert hint in info.value.hint
    else:
        assert "moving averages v + c * (x - v)" in info.value.hint


def test_lerp_nonneg_matches_a_float32_computation():
    # The proof's claim, on fp32 values near the edges: the average never goes below 0.
    import torch

    torch.manual_seed(0)
    g = torch.randn(100000, dtype=torch.float32) * torch.logspace(-15, 15, 100000)
    v = torch.rand(100000, dtype=torch.float32) * torch.logspace(30, -30, 100000)
    v[::7] = (g * g)[::7]  # ties
    for c in (0.0, 1e-8, 0.001, 0.5, 0.999, 1.0):
        c32 = torch.tensor(c, dtype=torch.float32)
        for value in (v + c32 * (g * g - v), v - c32 * (v - g * g), v - c32 * torch.sign(v - g * g) * g * g):
            assert not value.isnan().any() and (value >= 0).all()


# -- long programs -------------------------------------------------------------

@pytest.mark.parametrize("first", ["grad", "lr"])  # a per-element chain and a host chain
def test_five_thousand_chained_temporaries_lower(first):
    n = 5000
    body = f"    t1 = {first}\n" + "".join(f"    t{i + 1} = t{i} * 1.0001\n" for i in range(1, n))
    spec = load(f"optimizer chain\nhyper lr = 1\nupdate {{\n{body}    param = param - lr * grad * t{n}\n}}\n")
    (low,) = lower_all(spec)
    assert len(low.host) + len(low.elem) >= n - 1


def test_deeply_nested_expression_is_a_spec_error():
    for inner in ["(" * 3000 + "grad" + " + 1)" * 3000, "sqrt(" * 3000 + "grad" + ")" * 3000,
                  "(" * 3000 + "-(" * 3000 + "grad" + "))" * 3000]:
        with pytest.raises(SpecError, match="nested too deeply"):
            load(f"optimizer deep\nhyper lr = 1\nupdate {{\n    param = param - lr * ({inner} + 1)\n}}\n")
    # parentheses alone do not nest the expression: this is just grad
    spec = load("optimizer deep\nhyper lr = 1\nupdate {\n    param = param - lr * " + "(" * 3000 + "grad"
                + ")" * 3000 + "\n}\n")
    assert spec.body[0].value.right.right == ir.Name("grad")


# -- strings -------------------------------------------------------------------

@pytest.mark.parametrize("char", ["\x00", "\x01", "\x1b", "\x7f", "\x9f"])
def test_strings_refuse_control_characters(char):
    for text in [f'optimizer t "a{char}b"\nhyper lr = 1\nupdate {{ param = param - lr * grad }}\n',
                 f'optimizer t\nhyper lr = 1\nrequire lr > 0, "a{char}b"\nupdate {{ param = param - lr * grad }}\n']:
        with pytest.raises(SpecError) as info:
            load(text)
        assert info.value.message == f"syntax error: a string may not contain the control character U+{ord(char):04X}"
        line = text.split("\n")[info.value.loc.line - 1]
        assert line[info.value.loc.col - 1] == char


def test_strings_keep_tabs():
    assert load('optimizer t "a\tb"\nhyper lr = 1\nupdate { param = param - lr * grad }\n').doc == "a\tb"


# -- idioms --------------------------------------------------------------------

def test_state_from_param_is_exact_and_unbounded():
    spec = load("optimizer sf\nhyper lr = 1\nstate z = param\nstate n = -param\nstate m = 0 exact\nstate w = 0\n"
                "update {\n    z = z - lr * grad\n    n = n + z\n    m = m + grad\n    w = w + grad\n"
                "    param = z + n + m + w\n}\n")
    z, n, m, w = spec.states
    assert z.init == ir.Name("param") and z.starts_from_param and z.must_stay_exact and not z.exact
    assert n.init == ir.Unary("neg", ir.Name("param")) and n.starts_from_param
    assert m.exact and m.must_stay_exact and not m.starts_from_param
    assert not w.must_stay_exact


def test_negated_hyperparameter_initial_value():
    spec = load("optimizer t\nhyper lr = 1\nhyper a = 2\nstate m = -a\nupdate {\n    m = m + grad\n"
                "    param = param - lr * m\n}\n")
    assert spec.states[0].init == ir.Unary("neg", ir.Name("a"))


OPTIONAL = """optimizer ademamix_like
hyper lr = 1e-3 in [0, inf)
hyper t_alpha = none in [1, inf)
flag has_t = given(t_alpha)
flag warm = given(t_alpha) and lr > 0.5
require given(t_alpha) or lr < 1, "without t_alpha, lr must be below 1"

update {
    ramp = where(has_t, min(step / t_alpha, 1), 1)
    if warm {
        ramp = ramp * t_alpha
    }
    param = param - lr * ramp * grad
}
"""


def test_optional_hyperparameter_resolves_to_none_and_sets_its_flag():
    spec = load(OPTIONAL)
    (h,) = [h for h in spec.hypers if h.name == "t_alpha"]
    assert h.optional and h.default is None
    assert spec.keyword_defaults()["t_alpha"] is None
    off = resolve_hypers(spec, {})
    assert off.hypers["t_alpha"] is None and off.flags == {"has_t": False, "warm": False}
    assert resolve_hypers(spec, {"t_alpha": None}).flags["has_t"] is False
    on = resolve_hypers(spec, {"t_alpha": 10, "lr": 0.75})
    assert on.hypers["t_alpha"] == 10.0 and on.flags == {"has_t": True, "warm": True}
    with pytest.raises(ValueError, match=r"Invalid t_alpha: 0.5; ademamix_like expects a value in \[1, inf\)"):
        resolve_hypers(spec, {"t_alpha": 0.5})
    with pytest.raises(ValueError, match="without t_alpha, lr must be below 1"):
        resolve_hypers(spec, {"lr": 2.0})
    # the lowered programs read t_alpha only where it is given
    for low in lower_all(spec):
        reads = {a.name for i in low.host + low.elem for a in i.args if a.kind == "hyper"}
        flags = dict(low.combo)
        if flags["has_t"]:
            assert "t_alpha" in reads, low.describe()
        if "t_alpha" in reads:
            assert flags["has_t"] or flags["warm"], low.describe()


def test_optional_guard_must_imply_given():
    text = OPTIONAL.replace("flag warm = given(t_alpha) and lr > 0.5", "flag warm = given(t_alpha) or lr > 0.5")
    with pytest.raises(SpecError, match=r"'t_alpha' may be none here \(when has_t=false, warm=true\)"):
        load(text)


CHOICE = """
optimizer signed_or_not
hyper lr = 1e-3 in [0, inf)
choice mode = none in ("plain", "by_sign", "clipped")
flag signed = mode == "by_sign"
flag clipped = mode == "clipped"
require mode != "clipped" or lr <= 1, "clipped needs lr <= 1"

update {
    if signed {
        param = param - lr * sign(grad)
    } else if clipped {
        param = param - lr * clamp(grad, -1, 1)
    } else {
        param = param - lr * grad
    }
}
"""


def test_choice_resolves_to_its_word_and_sets_its_flags():
    """A choice keyword: None (its default) or one of its words, read by derived flags and requires; anything
    else refused naming it."""
    spec = load(CHOICE)
    assert spec.keyword_defaults()["mode"] is None
    assert resolve_hypers(spec, {}).flags == {"signed": False, "clipped": False}
    assert resolve_hypers(spec, {"mode": "plain"}).flags == {"signed": False, "clipped": False}
    on = resolve_hypers(spec, {"mode": "by_sign"})
    assert on.flags == {"signed": True, "clipped": False} and on.choices == {"mode": "by_sign"}
    assert resolve_hypers(spec, {"mode": "clipped"}).combo == (("signed", False), ("clipped", True))
    with pytest.raises(ValueError, match="clipped needs lr <= 1"):
        resolve_hypers(spec, {"mode": "clipped", "lr": 2.0})
    message = r"Invalid mode: 'by_signs'; signed_or_not expects one of 'plain', 'by_sign', 'clipped' or None; did"
    with pytest.raises(ValueError, match=message):
        resolve_hypers(spec, {"mode": "by_signs"})
    for bad in (True, 1, b"by_sign", ("by_sign",)):
        with pytest.raises(ValueError, match="Invalid mode"):
            resolve_hypers(spec, {"mode": bad})
    # without 'none', None is refused and the default word is used
    fixed = load(CHOICE.replace('= none in', '= "plain" in'))
    assert resolve_hypers(fixed, {}).choices == {"mode": "plain"}
    with pytest.raises(ValueError, match="expects one of 'plain', 'by_sign', 'clipped'$"):
        resolve_hypers(fixed, {"mode": None})
    # each word lowers to its own variant; the generated source holds no word
    from forge_dsl.compiler.codegen import render_module
    source = render_module(spec)
    assert not any(f"{q}{word}{q}" in source for word in ("plain", "by_sign") for q in "'\"")


def test_cached_keywords_tell_words_apart():
    """kernels.steps remembers resolved keywords; two words (or a word and None) are two entries."""
    from forge_dsl.kernels.steps import resolved_hypers
    spec = load(CHOICE)
    assert resolved_hypers(spec, {"mode": "by_sign"}).flags["signed"] is True
    assert resolved_hypers(spec, {"mode": "clipped"}).flags["signed"] is False
    assert resolved_hypers(spec, {"mode": None}).flags == {"signed": False, "clipped": False}
    assert resolved_hypers(spec, {"mode": "by_sign"}).flags["signed"] is True


# -- characters that hide code, and characters pasted from elsewhere ----------

# Line breaks to editors but not to the lexer, and bidirectional-text controls (Trojan Source).
HIDING = [0x2028, 0x2029, 0x85, 0x202A, 0x202B, 0x202C, 0x202D, 0x202E, 0x2066, 0x2067, 0x2068, 0x2069, 0x200E,
          0x200F, 0x061C]
HIDING_PLACES = {
    "comment": ("optimizer t\nhyper lr = 1\nupdate {{\n    # clip{c}param = param * 0\n"
                "    param = param - lr * grad\n}}\n"),
    "string": 'optimizer t "a{c}b"\nhyper lr = 1\nupdate {{ param = param - lr * grad }}\n',
    "code": "optimizer t\nhyper lr = 1\nupdate {{\n    param = param - lr * grad{c}\n}}\n",
}


@pytest.mark.parametrize("place", sorted(HIDING_PLACES))
@pytest.mark.parametrize("code", HIDING, ids=lambda c: f"U+{c:04X}")
def test_characters_that_hide_code_are_refused_anywhere(code, place):
    """A comment that an editor ends at U+2028 (or reorders with U+202E) shows code the lexer never reads."""
    import unicodedata

    c = chr(code)
    text = HIDING_PLACES[place].format(c=c)
    with pytest.raises(SpecError) as info:
        load(text)
    name = "NEXT LINE" if code == 0x85 else unicodedata.name(c)
    assert f"the character U+{code:04X} {name} is not allowed in a spec" in info.value.message
    loc = info.value.loc
    assert text.split("\n")[loc.line - 1][loc.col - 1] == c
    assert c not in str(info.value)  # the quoted line shows a replacement, not the character itself


# (text with `{c}` where the character goes, the character, what the hint says)
PASTED = [
    ("    param = p{c}ram - lr * grad", "\u0430",
     "only ASCII letters, digits and '_' may form a name; this 'а' looks like the Latin 'a'"),
    ("    param = param - lr * grad * b{c}ta", "\u00e9", "only ASCII letters, digits and '_' may form a name"),
    ("    param = param - lr * gr{c}d", "\u03bf", "looks like the Latin 'o'"),
    ("    param = param {c} lr * grad", "\u2212", "use '-'"),
    ("    param = param {c} lr * grad", "\u2013", "use '-'"),
    ("    param = param {c} lr * grad", "\u2014", "use '-'"),
    ("    param = param - lr {c} grad", "\u00d7", "use '*'"),
    ("    param = param - lr {c} grad", "\u00f7", "use '/'"),
    ("    param = param {c} lr * grad", "\uff0b", "use '+'"),
    ("    param = where(grad {c} 0, param, param - lr * grad)", "\u2264", "use '<='"),
    ("    param = param -{c}lr * grad", "\u00a0", "use an ordinary space"),
    ("    param = param -{c}lr * grad", "\u200b", "delete it"),
    ("    param = param - lr * grad  {c}", "\u201c", "use '\"'"),
]


@pytest.mark.parametrize("line, char, hint", PASTED, ids=lambda v: f"U+{ord(v):04X}" if len(v) == 1 else None)
def test_pasted_characters_say_their_code_point_and_a_hint(line, char, hint):
    import unicodedata

    text = f"optimizer t\nhyper lr = 1\nhyper bta = 1\nhyper gramd = 1\nupdate {{\n{line.format(c=char)}\n}}\n"
    with pytest.raises(SpecError) as info:
        load(text)
    point = f"U+{ord(char):04X} {unicodedata.name(char)}"
    assert info.value.message.startswith("syntax error: unexpected character ")
    assert info.value.message.endswith(f"({point})" if char.isprintable() and not char.isspace() else point)
    assert hint in info.value.hint
    loc = info.value.loc
    assert text.split("\n")[loc.line - 1][loc.col - 1] == char


# -- number literals: underflow and overflow, and defaults in fp32 -------------

LITERAL_PLACES = [
    "hyper eps = {n} in (0, inf)\nupdate {{\n    param = param - lr * grad * eps\n}}",
    "hyper eps = -{n}\nupdate {{\n    param = param - lr * grad * eps\n}}",
    "hyper eps = 1 in [{n}, inf)\nupdate {{\n    param = param - lr * grad * eps\n}}",
    "hyper pair = (e1 = 1, e2 = {n})\nupdate {{\n    param = param - lr * grad * e1 * e2\n}}",
    "state m = {n}\nupdate {{\n    m = m + grad\n    param = param - lr * m\n}}",
    "update {{\n    param = param - lr * grad * {n}\n}}",
]


@pytest.mark.parametrize("place", LITERAL_PLACES,
                         ids=["default", "negative_default", "bound", "tuple_member", "initial_value", "expression"])
@pytest.mark.parametrize("number, what", [("1e-400", "is too small for a float: it underflows to 0"),
                                          ("0.00001e-320", "is too small for a float: it underflows to 0"),
                                          ("1e999", "is too large for a float")])
def test_literals_that_underflow_or_overflow_are_refused_where_written(place, number, what):
    text = "optimizer t\nhyper lr = 1\n" + place.format(n=number) + "\n"
    with pytest.raises(SpecError) as info:
        load(text)
    assert info.value.message == f"number '{number}' {what}"
    loc = info.value.loc
    assert text.split("\n")[loc.line - 1][loc.col - 1:loc.end_col - 1] == number


@pytest.mark.parametrize("number, value", [("1e-310", 1e-310), ("0e-999", 0.0), ("0.000e-400", 0.0), (".0", 0.0),
                                           ("4.9e-324", 5e-324)])
def test_zero_and_subnormal_literals_load(number, value):
    spec = load(f"optimizer t\nhyper lr = 1\nhyper eps = {number}\nupdate {{\n    param = param - lr * grad * eps\n}}"
                "\n")
    assert spec.hypers[1].default == value


FP32_DEFAULTS = [  # (declaration, its default as written, the message)
    ("hyper eps = 1e-50 in (0, inf)", "1e-50", "the default 1e-50 of 'eps' is 0 in fp32, outside its range (0, inf)"),
    ("hyper eps = 0.99999999 in [0, 1)", "0.99999999",
     "the default 0.99999999 of 'eps' is 1 in fp32, outside its range [0, 1)"),
    ("hyper eps = 1e39 in [0, inf)", "1e39", "the default 1e+39 of 'eps' is inf in fp32, outside its range [0, inf)"),
    ("hyper eps = -1e-50 in (-inf, 0)", "-1e-50",
     "the default -1e-50 of 'eps' is -0 in fp32, outside its range (-inf, 0)"),
    ("hyper e = (eps = 0.5, e2 = 1e-46) in (0, 1)", "1e-46",
     "the default 1e-46 of 'e2' is 0 in fp32, outside its range (0, 1)"),
]


@pytest.mark.parametrize("decl, default, message", FP32_DEFAULTS)
def test_default_whose_fp32_value_leaves_its_range_is_refused_at_the_default(decl, default, message):
    uses = " * e2" if "e2" in decl else ""
    text = f"optimizer t\nhyper lr = 1\n{decl}\nupdate {{\n    param = param - lr * grad * eps{uses}\n}}\n"
    with pytest.raises(SpecError) as info:
        load(text)
    assert info.value.message == message
    loc = info.value.loc
    assert text.split("\n")[loc.line - 1][loc.col - 1:loc.end_col - 1] == default
    assert "fp32" in info.value.hint


@pytest.mark.parametrize("decl", ["hyper eps = 1e-50", "hyper eps = 1e-45 in (0, inf)", "hyper eps = 0.1 in [0, 0.1]",
                                  "hyper eps = 3e38 in [0, inf)", "hyper eps = 0 in [0, inf)"])
def test_defaults_that_fp32_holds_inside_their_range_load(decl):
    load(f"optimizer t\nhyper lr = 1\n{decl}\nupdate {{\n    param = param - lr * grad * eps\n}}\n")


# -- the nonneg proof: bias corrections (step >= 1, an integer) ---------------

BIAS_CORRECTED = [
    "grad * grad / (1 - b ** step)",             # (1 - b ** step) is in (0, 1] for b in [0, 1)
    "max(v, grad * grad / (1 - b ** step))",     # schedule-free AdamW's ams_bound
    "v / (1 - b)",
    "v * (1 - (b - 1) ** step)",                 # |b - 1| <= 1: an integer power stays in [-1, 1]
    "v + (1 - b ** step) * (grad * grad - v)",
]


@pytest.mark.parametrize("value", BIAS_CORRECTED)
def test_bias_corrections_are_proven(value):
    load(nonneg_spec(value, BETA))


NOT_BIAS_CORRECTED = [
    "grad * grad / (1 - c ** step)",             # c may be 1: 1 - c ** step may be 0
    "grad * grad / (1 - b ** (step - 1))",       # b ** 0 is 1
    "grad * grad / (1 - b ** lr)",               # lr may be 0
    "v * (1 - (b - 2) ** step)",                 # (b - 2) ** step is unbounded
]


@pytest.mark.parametrize("value", NOT_BIAS_CORRECTED)
def test_bias_corrections_that_can_divide_by_zero_are_refused(value):
    with pytest.raises(SpecError, match="declared nonneg, but this value can be negative"):
        load(nonneg_spec(value, BETA))
