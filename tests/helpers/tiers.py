"""The test tiers (pyproject.toml): `pytest` runs the quick tier, every test not marked `slow`; `pytest -m slow`
runs the rest. A sweep over several axes keeps a few of its cases in the quick tier and marks the others slow:

    @pytest.mark.parametrize(*sweep(("name", SPECS), ("layout", ["fp32", "int8"]), quick={"adamw-int8"}))

gives the cases, order and ids of the stacked decorators

    @pytest.mark.parametrize("layout", ["fp32", "int8"])
    @pytest.mark.parametrize("name", SPECS)

(the first axis is the decorator nearest the function), with every case slow but `quick`'s. An axis of several
arguments, ("dtype, dim", [(torch.float32, 136), ...], ids), is one decorator of several names.
"""

from __future__ import annotations

import itertools
from typing import Iterable, Optional

import pytest

SLOW = pytest.mark.slow


def _id(value) -> str:
    if value is None or isinstance(value, (str, int, float, bool)):
        return str(value)
    raise TypeError(f"{value!r} needs an explicit id: give the axis as (name, values, ids)")


def covering(*lengths: int) -> set[tuple[int, ...]]:
    """Indices of as many cases as the longest axis has values, the i-th taking each axis's (i mod its length)-th
    value: every value of every axis runs once."""
    return {tuple(i % n for n in lengths) for i in range(max(lengths))}


def sweep(*axes: tuple, quick: Optional[Iterable[str]] = None) -> tuple[str, list]:
    """(argnames, params) for `pytest.mark.parametrize`: the product of `axes`, each (name, values) or
    (name, values, ids), ids needed where a value is not a str, number, bool or None. The cases whose id is in
    `quick` stay in the quick tier (by default a covering set, see `covering`); the others are marked slow. An id
    in `quick` that names no case is an error."""
    names = [axis[0] for axis in axes]
    several = [len(name.split(",")) > 1 for name in names]  # a value is a tuple of arguments
    values = [list(axis[1]) for axis in axes]
    ids = [list(axis[2]) if len(axis) > 2 else [_id(v) for v in vals] for axis, vals in zip(axes, values)]
    cases = list(itertools.product(*(range(len(v)) for v in values)))
    case_id = {case: "-".join(ids[j][i] for j, i in enumerate(case)) for case in cases}
    if quick is None:
        kept = covering(*(len(v) for v in values))
    else:
        quick = set(quick)
        unknown = quick - set(case_id.values())
        if unknown:
            raise ValueError(f"quick names no case: {sorted(unknown)}")
        kept = {case for case in cases if case_id[case] in quick}
    params = []
    for case in cases:
        args = [values[j][i] if several[j] else (values[j][i],) for j, i in enumerate(case)]
        params.append(pytest.param(*itertools.chain(*args), id=case_id[case], marks=() if case in kept else SLOW))
    return ", ".join(names), params
