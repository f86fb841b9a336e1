"""The one error type for problems in a `.fopt` spec, and where they happened.

Every stage of the compiler (parser, checker, lowering) reports a problem in a
spec by raising `SpecError` with the `Loc` of the offending token.  Printed, it
reads like a compiler diagnostic::

    optimizers/adamw.fopt:14:12: unknown function 'sqr'; did you mean 'sqrt'?
        denom = sqr(v) + eps
                ^^^
"""

from __future__ import annotations

import difflib
import unicodedata
from dataclasses import dataclass
from typing import Iterable, Optional

__all__ = ["HIDING_CHARACTERS", "Loc", "SpecError", "character_name", "did_you_mean", "pasted_character_hint",
           "shown_character"]

# Characters a spec may not hold anywhere, comments and strings included (docs/LANGUAGE.md, 2): line breaks to
# editors that the lexer does not count (what an editor shows after one in a comment as code is comment), and
# the bidirectional-text controls that reorder what an editor shows (Trojan Source, CVE-2021-42574).
LINE_BREAKS = frozenset("\u2028\u2029\x85")
BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c")
HIDING_CHARACTERS = LINE_BREAKS | BIDI_CONTROLS


def character_name(c: str) -> str:
    """`U+2028 LINE SEPARATOR`: a character's code point and Unicode name (a control character's alias)."""
    name = unicodedata.name(c, None) or {"\x85": "NEXT LINE"}.get(c)
    return f"U+{ord(c):04X}" + (f" {name}" if name else "")


def _showable(c: str) -> str:
    """`c` as a quoted line shows it: a control character or a character of HIDING_CHARACTERS (which would
    break or reorder the quoted line, or drive the terminal) as U+FFFD; tabs as they are."""
    if c == "\t" or (c not in HIDING_CHARACTERS and unicodedata.category(c) != "Cc"):
        return c
    return "\ufffd"


@dataclass(frozen=True)
class Loc:
    """A span in a spec file: 1-based line and column of its first character."""

    path: str
    line: int
    col: int
    end_line: int = 0
    end_col: int = 0

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.col}"


class SpecError(Exception):
    """A problem in a `.fopt` spec, printed as `path:line:col: message`, the line and a caret.

    Attributes:
        message: the problem in one sentence, without the location.
        loc: where it is, or None for problems with no single place.
        source: the spec's text (to quote the line), or None.
        hint: an optional second sentence that says what to do.
    """

    def __init__(
        self,
        message: str,
        loc: Optional[Loc] = None,
        source: Optional[str] = None,
        hint: Optional[str] = None,
    ) -> None:
        self.message = message
        self.loc = loc
        self.source = source
        self.hint = hint
        super().__init__(self.render())

    def with_source(self, source: str) -> "SpecError":
        """The same error, able to quote its line from `source`."""
        return SpecError(self.message, self.loc, source, self.hint)

    def render(self) -> str:
        head = f"{self.loc}: {self.message}" if self.loc else self.message
        lines = [head]
        if self.loc and self.source is not None:
            # Lines are counted at '\n' only, as the parser counts them.
            text_lines = self.source.split("\n")
            if 1 <= self.loc.line <= len(text_lines):
                text = "".join(map(_showable, text_lines[self.loc.line - 1])).rstrip()
                width = 1
                if self.loc.end_line == self.loc.line and self.loc.end_col > self.loc.col:
                    width = self.loc.end_col - self.loc.col
                # Keep the line's tabs under the caret so that it lines up.
                pad = "".join(c if c == "\t" else " " for c in text[: self.loc.col - 1])
                pad += " " * (self.loc.col - 1 - len(pad))
                lines.append("    " + text)
                lines.append("    " + pad + "^" * width)
        if self.hint:
            lines.append(f"hint: {self.hint}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """`"; did you mean 'x'?"` for the closest candidate, or `""` when none is close."""
    close = difflib.get_close_matches(word, sorted(set(candidates)), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def shown_character(c: str) -> str:
    """`'$'`; beyond ASCII, with its code point and name: `'а' (U+0430 CYRILLIC SMALL LETTER A)`, and without
    the character itself where it shows as nothing or as a space (`U+00A0 NO-BREAK SPACE`)."""
    if c.isascii() and c.isprintable():
        return f"'{c}'"
    return f"'{c}' ({character_name(c)})" if c.isprintable() and not c.isspace() else character_name(c)


# Characters pasted from documents and papers, and the ASCII the language spells them with.
_ASCII_FOR = {
    **dict.fromkeys("\u2010\u2011\u2012\u2013\u2014\u2015\u2212\ufe58\ufe63", "-"),
    **dict.fromkeys("\u00d7\u00b7\u2217\u2219\u22c5", "*"),
    **dict.fromkeys("\u00f7\u2044\u2215", "/"),
    **dict.fromkeys("\u2018\u2019\u201a\u201b\u201c\u201d\u201e\u201f\u00ab\u00bb\u2032\u2033", '"'),
    "\u2264": "<=", "\u2265": ">=", "\u2260": "!=", "\u2227": "and", "\u2228": "or", "\u00ac": "not",
    "\u221e": "inf",
}
# Letters of other scripts that look like Latin ones (homoglyphs), and the Latin letter each looks like.
_LOOKALIKES = dict(zip("аеорсухіјѕԁӏԛԝАВЕКМНОРСТХІЈЅαοινκρτυχΑΒΕΖΗΙΚΜΝΟΡΤΥΧ",
                       "aeopcyxijsdlqwABEKMHOPCTXIJSaoivkptuxABEZHIKMNOPTYX"))
_INVISIBLE = set("\u200b\u200c\u200d\u2060\ufeff\u00ad")


def pasted_character_hint(c: str) -> Optional[str]:
    """What to write instead of a character the lexer refuses, where one can say: `use '-'` for U+2212."""
    if c in _ASCII_FOR:
        return f"use '{_ASCII_FOR[c]}'"
    if c in _INVISIBLE:
        return "delete it: it is invisible, and not part of the language"
    if unicodedata.category(c) == "Zs":
        return "use an ordinary space"
    ascii_form = unicodedata.normalize("NFKC", c)
    if ascii_form != c and ascii_form.isascii() and ascii_form.isprintable() and ascii_form.strip():
        return f"use '{ascii_form}'"
    if c.isalnum() and not c.isascii():
        hint = "only ASCII letters, digits and '_' may form a name"
        if c in _LOOKALIKES:
            hint += f"; this '{c}' looks like the Latin '{_LOOKALIKES[c]}'"
        return hint
    return None
