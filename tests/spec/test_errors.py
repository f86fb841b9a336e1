"""The error corpus: every malformed spec in tests/spec/error_corpus/ gives exactly its message.

Each `NN_short_name.fopt` is loaded (parse, then check) with the path
`tests/spec/error_corpus/NN_short_name.fopt`; `str()` of the `SpecError` it raises
must equal `NN_short_name.expected` character for character (no trailing
newline is added).  After a deliberate change to a message, regenerate the
expected files with

    FORGE_REGEN_ERROR_CORPUS=1 pytest tests/spec/test_errors.py

and read the diff.
"""

from __future__ import annotations

import os

import pytest

from forge_dsl.spec.checker import check_spec
from forge_dsl.spec.errors import SpecError
from forge_dsl.spec.parser import parse_spec
from repo import ROOT

CORPUS = ROOT / "tests" / "spec" / "error_corpus"
CASES = sorted(p.stem for p in CORPUS.glob("*.fopt"))
REGEN = os.environ.get("FORGE_REGEN_ERROR_CORPUS") == "1"


def read(path) -> str:
    """A corpus file's text exactly: UTF-8, no newline translation (cases hold U+2028, U+0085, ...)."""
    return path.read_bytes().decode("utf-8")


def load_error(stem: str) -> SpecError:
    rel = f"tests/spec/error_corpus/{stem}.fopt"
    text = read(CORPUS / f"{stem}.fopt")
    with pytest.raises(SpecError) as info:
        check_spec(parse_spec(text, rel))
    return info.value


def test_corpus_is_large_and_paired():
    assert len(CASES) >= 40
    expected = sorted(p.stem for p in CORPUS.glob("*.expected"))
    assert expected == CASES, "every .fopt needs its .expected, and no .expected may be orphaned"


@pytest.mark.parametrize("stem", CASES)
def test_error_message(stem):
    err = load_error(stem)
    expected_path = CORPUS / f"{stem}.expected"
    if REGEN:
        expected_path.write_text(str(err), encoding="utf-8")
    assert str(err) == read(expected_path)


@pytest.mark.parametrize("stem", CASES)
def test_error_is_located_in_the_file(stem):
    err = load_error(stem)
    assert err.loc is not None and err.loc.path == f"tests/spec/error_corpus/{stem}.fopt"
    lines = read(CORPUS / f"{stem}.fopt").split("\n")
    assert 1 <= err.loc.line <= len(lines)
    assert 1 <= err.loc.col <= len(lines[err.loc.line - 1]) + 1
