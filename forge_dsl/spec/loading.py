"""Loading a spec: a built-in name, a path to a `.fopt` file, or an `ir.Spec` as it is.

    spec = load_spec("adamw")            # optimizers/adamw.fopt, parsed and checked
    spec = load_spec("my_opt.fopt")      # any file; its errors are `path:line:col: message`

Parsing and checking happen once per text (cached). Nothing here imports torch.
"""

from __future__ import annotations

import functools
import os
from importlib import resources
from pathlib import Path
from typing import Union

from . import ir
from .checker import check_spec
from .errors import Loc, SpecError, did_you_mean
from .parser import parse_spec

__all__ = ["load_spec", "builtin_names", "builtin_path", "SpecLike"]

SpecLike = Union[str, os.PathLike, ir.Spec]


def builtin_names() -> list[str]:
    """Names of the specs shipped in optimizers/ (forge_dsl.optimizers)."""
    return list(_builtin_names())


@functools.lru_cache(maxsize=1)
def _builtin_names() -> tuple[str, ...]:
    root = resources.files("forge_dsl.optimizers")
    return tuple(sorted(p.name[: -len(".fopt")] for p in root.iterdir() if p.name.endswith(".fopt")))


def builtin_path(name: str) -> Path:
    return Path(str(resources.files("forge_dsl.optimizers").joinpath(f"{name}.fopt")))


def _read_spec_file(path: Path, shown: str) -> str:
    """The text of a spec file: UTF-8, line ends made '\\n' (as Python's text mode does).

    Raises:
        SpecError: the bytes are not UTF-8 (located at the first bad byte, `shown` as the file's name).
        OSError: the file cannot be read.
    """
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        before = _newlines(data[: err.start].decode("utf-8"))
        line = before.count("\n") + 1
        col = len(before) - (before.rfind("\n") + 1) + 1
        byte = f"byte 0x{data[err.start]:02x}"
        why = {"invalid start byte": f"{byte} cannot start a character",
               "invalid continuation byte": f"{byte} starts a character that the bytes after it do not continue",
               "unexpected end of data": f"the file ends inside the character that {byte} starts"}
        raise SpecError(
            f"the file is not UTF-8: {why.get(err.reason, f'{err.reason} at {byte}')}",
            Loc(shown, line, col, line, col + 1),
            _newlines(data.decode("utf-8", errors="replace")),
            hint="save the spec as UTF-8",
        ) from None
    return _newlines(text)


def _newlines(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


@functools.lru_cache(maxsize=128)
def _load_text(source: str, path: str) -> ir.Spec:
    return check_spec(parse_spec(source, path))


def load_spec(spec: SpecLike) -> ir.Spec:
    """Parse and check a spec.

    Args:
        spec: a built-in name such as "adamw", a path to a `.fopt` file, or an `ir.Spec`
            (returned as is).

    Raises:
        SpecError: the spec has a problem (printed as `path:line:col: message`), its file
            not UTF-8 included.
        FileNotFoundError: no such built-in name or file.
        OSError: the file cannot be read.
    """
    if isinstance(spec, ir.Spec):
        return spec
    text = os.fspath(spec)
    if text.endswith(".fopt") or os.sep in text or "/" in text:
        path = Path(text)
        if not path.is_file():
            raise FileNotFoundError(f"no spec file at '{text}'")
        return _load_text(_read_spec_file(path, text), text)
    return _load_builtin(text)


@functools.lru_cache(maxsize=64)
def _load_builtin(text: str) -> ir.Spec:
    names = builtin_names()
    if text not in names:
        raise FileNotFoundError(
            f"no built-in optimizer named '{text}'" + did_you_mean(text, names)
            + f" (built-ins: {', '.join(names)}; or pass a path to a .fopt file)"
        )
    path = builtin_path(text)
    shown = f"optimizers/{text}.fopt"
    return _load_text(_read_spec_file(path, shown), shown)
