"""docs/LANGUAGE.md stays true: its examples load, its errors are errors, Adamax matches torch.

* every ```fopt block is a complete, valid spec (parse + check);
* every ```fopt-error block raises SpecError;
* the Adamax worked example matches torch.optim.Adamax in float64 over 5 steps;
* every message of the error corpus is listed in the doc's list of messages.
"""

from __future__ import annotations

import re

import pytest
import torch

import forge_dsl
from forge_dsl.spec.checker import check_spec
from forge_dsl.spec.errors import SpecError
from forge_dsl.spec.parser import parse_spec
from repo import ROOT

DOC = ROOT / "docs" / "LANGUAGE.md"
TEXT = DOC.read_text(encoding="utf-8")
BLOCK = re.compile(r"^```(fopt|fopt-error)[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
BLOCKS = [(m.group(1), m.group(2), TEXT.count("\n", 0, m.start()) + 2) for m in BLOCK.finditer(TEXT)]
VALID = [(text, line) for kind, text, line in BLOCKS if kind == "fopt"]
ERRORS = [(text, line) for kind, text, line in BLOCKS if kind == "fopt-error"]


def _load(text: str, line: int):
    return check_spec(parse_spec(text, f"docs/LANGUAGE.md@{line}"))


def test_doc_has_examples():
    assert len(VALID) >= 5 and len(ERRORS) >= 1
    # Nothing that looks like a spec hides in an unchecked fence.
    for m in re.finditer(r"^```(\w[\w-]*)?[ \t]*\n(.*?)^```", TEXT, re.MULTILINE | re.DOTALL):
        if m.group(1) not in ("fopt", "fopt-error"):
            assert not re.search(r"^\s*optimizer \w+", m.group(2), re.MULTILINE) or "update {" not in m.group(2), (
                "a complete spec must be fenced as fopt or fopt-error"
            )


@pytest.mark.parametrize("text,line", VALID, ids=[f"line{line}" for _, line in VALID])
def test_fopt_blocks_are_valid_specs(text, line):
    _load(text, line)


@pytest.mark.parametrize("text,line", ERRORS, ids=[f"line{line}" for _, line in ERRORS])
def test_fopt_error_blocks_raise_spec_error(text, line):
    with pytest.raises(SpecError):
        _load(text, line)


def _adamax_spec():
    blocks = [(t, line) for t, line in VALID if re.search(r"^optimizer adamax\b", t, re.MULTILINE)]
    assert len(blocks) == 1, "the worked example must be the one block declaring 'optimizer adamax'"
    return _load(*blocks[0])


@pytest.mark.parametrize(
    "keywords",
    [
        {},
        dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.1, maximize=False),
        dict(lr=3e-3, betas=(0.5, 0.9), eps=1e-6, weight_decay=0.0, maximize=True),
    ],
    ids=["defaults", "weight_decay", "maximize"],
)
def test_adamax_example_matches_torch(keywords):
    spec = _adamax_spec()
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(257, dtype=torch.float64, generator=gen).requires_grad_()
    mine = ref.detach().clone()
    opt = torch.optim.Adamax([ref], **keywords)
    state = forge_dsl.init_state(spec, mine, **keywords)
    for step in range(1, 6):
        grad = torch.randn(257, dtype=torch.float64, generator=gen)
        ref.grad = grad.clone()
        opt.step()
        forge_dsl.reference_step(spec, mine, grad, state, step=step, **keywords)
        expected = ref.detach()
        rel = ((mine - expected).abs() / expected.abs().clamp_min(1e-300)).max().item()
        assert rel <= 1e-10, f"step {step}: relative error {rel:.3g}"
        torch_state = opt.state[ref]
        assert torch.allclose(state["exp_avg"], torch_state["exp_avg"], rtol=1e-10, atol=0)
        assert torch.allclose(state["exp_inf"], torch_state["exp_inf"], rtol=1e-10, atol=0)


def test_error_list_covers_the_corpus():
    corpus = ROOT / "tests" / "spec" / "error_corpus"
    missing = []
    for expected in sorted(corpus.glob("*.expected")):
        head = expected.read_bytes().decode("utf-8").split("\n")[0]
        message = re.sub(r"^tests/spec/error_corpus/[^:]+:\d+:\d+: ", "", head)
        if f"`{message}`" not in TEXT:
            missing.append(f"{expected.stem}: {message}")
    assert not missing, "docs/LANGUAGE.md section 11 lacks:\n" + "\n".join(missing)
