"""What a kernel check runs on: hyperparameters drawn inside their ranges, flag combinations, random layers.

`draw_keywords` draws every hyperparameter of a spec away from its default inside its declared range
(uniform where the range is bounded, log-uniform in a band around the default where it is not; weight
decay and other zero defaults non-zero), so that `config.resolve_hypers` gives the wanted flag
combination (derived flags follow from their hyperparameters) and passes every `require`.
`covering_combos` picks the flag combinations to run: all of them when there are few, else a set
that covers every pair of flag values.
"""

from __future__ import annotations

import itertools
import math
import random
from typing import Optional, Sequence

import torch

from ..spec import ir
from ..spec.keywords import resolve_hypers
from ..spec.variants import Combo, combinations

__all__ = ["default_device", "make_problem", "layout_for", "draw_keywords", "default_combo", "covering_combos",
           "N", "K", "T"]

N, K, T = 72, 136, 40  # none a multiple of the 64-wide blocks
ZERO_DEFAULT_BAND = (1e-3, 0.3)  # log-uniform draw of a hyperparameter whose default is 0 (weight decay, ...)
NO_DEFAULT_BAND = (0.05, 0.95)  # uniform draw of a required hyperparameter (SGD's momentum) where its range allows
ATTEMPTS = 200  # draws tried for one flag combination before it counts as unreachable


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_problem(seed: int, w_dtype: torch.dtype, n=N, k=K, t=T, act: Optional[torch.dtype] = None,
                 device: Optional[torch.device] = None):
    """(w [n, k], x [t, k], dy [t, n]) on `device` (default: CUDA when there is one); activations bf16 with
    bf16 weights, else fp32, unless `act`. w ~ N(0, 0.25), x ~ N(0, 1), dy ~ N(0, 0.01)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.5
    x = torch.randn(t, k, generator=gen)
    dy = torch.randn(t, n, generator=gen) * 0.1
    act = act or (torch.bfloat16 if w_dtype == torch.bfloat16 else torch.float32)
    device = device or default_device()
    return w.to(w_dtype).to(device), x.to(act).to(device), dy.to(act).to(device)


def layout_for(spec: ir.Spec, which):
    """`init_state`'s layout argument: "fp32", "bf16", "int8", or "mixed": int8, bf16, fp32 by turns over the
    spec's states that may be quantized (a dict; those that must stay exact are left out, so they stay fp32:
    `forge_dsl.api.state_layout`). A dict is returned as is."""
    if which != "mixed":
        return which
    choices = ["int8", "bf16", "fp32"]
    free = [s.name for s in spec.states if not s.must_stay_exact]
    return {name: choices[i % 3] for i, name in enumerate(free)}


# ----------------------------------------------------------------------------
# Hyperparameters
# ----------------------------------------------------------------------------


def _uniform(rng: random.Random, lo: float, hi: float) -> float:
    return rng.uniform(lo, hi)


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def draw_value(h: ir.Hyper, rng: random.Random) -> float:
    """One value of `h` inside its range, different from its default.

    Bounded ranges: uniform from halfway between the low end and the default to halfway between the
    default and the high end (the whole range where there is no default inside it). Half-bounded or
    unbounded: log-uniform over [default / 10, default * 10] for a positive default, over
    `ZERO_DEFAULT_BAND` for 0, uniform over `NO_DEFAULT_BAND` without one (its mirror image for ranges
    below 0).
    """
    iv, d = h.interval, h.default
    for _ in range(1000):
        if math.isfinite(iv.low) and math.isfinite(iv.high):
            lo, hi = iv.low, iv.high
            if d is not None and lo < d < hi:
                lo, hi = d - 0.5 * (d - lo), d + 0.5 * (hi - d)
            margin = 0.01 * (hi - lo)
            v = _uniform(rng, lo + margin, hi - margin)
        else:
            below = iv.high <= 0  # a range of negative values: the bands' mirror images
            if d is None:
                v = _uniform(rng, *NO_DEFAULT_BAND) * (-1 if below else 1)
            elif d == 0:
                v = _log_uniform(rng, *ZERO_DEFAULT_BAND) * (-1 if below else 1)
            else:
                v = math.copysign(_log_uniform(rng, abs(d) / 10, abs(d) * 10), d)
            if not iv.contains(v) and math.isfinite(iv.low):  # e.g. [1, inf): above its low end
                v = iv.low + abs(v)
            elif not iv.contains(v) and math.isfinite(iv.high):
                v = iv.high - abs(v)
        if iv.contains(v) and v != d:
            return float(v)
    raise ValueError(f"cannot draw a value of {h.name} in {iv} other than its default {d}")


def keywords_of(spec: ir.Spec, values: dict, flags: dict) -> dict:
    """torch-style keywords from scalar hyperparameter values and flag values (groups as tuples)."""
    grouped = {m for g in spec.groups for m in g.members}
    kw: dict = {}
    for h in spec.hypers:
        if h.name not in grouped:
            kw[h.name] = values[h.name]
    for g in spec.groups:
        kw[g.name] = tuple(values[m] for m in g.members)
    kw.update(flags)
    return kw


def draw_keywords(spec: ir.Spec, combo: Combo, rng: random.Random) -> Optional[dict]:
    """Keywords that select `combo` and pass every `require`, with as many hyperparameters away from their
    defaults as can be; None when no draw of `ATTEMPTS` reaches the combination (a contradictory one).

    Flags are set directly; a derived flag through its hyperparameters and choices (each drawn among its
    words, and None where that is its default): a draw that gives it the wrong
    value, or fails a `require`, is retried with some hyperparameters at their defaults (or, without
    one, 0 where the range holds it).
    """
    flags = {name: value for name, value in combo if name in spec.flag_names}
    best, best_moved = None, -1
    for attempt in range(ATTEMPTS):
        values = {}
        moved = 0
        for h in spec.hypers:
            # a hyperparameter with a default falls back to it, one without to 0 (never lr = 0: no update)
            fallback = [v for v in ((h.default,) if h.default is not None else (0.0,)) if h.interval.contains(v)]
            if attempt == 0 or not fallback or rng.random() < 0.6:
                try:
                    values[h.name] = draw_value(h, rng)
                    moved += 1
                except ValueError:  # a range of one value
                    values[h.name] = h.default
            else:
                values[h.name] = rng.choice(fallback)
                moved += values[h.name] != h.default
        kw = keywords_of(spec, values, flags)
        kw.update({c.name: rng.choice(c.values + (None,) * (c.default is None)) for c in spec.choices})
        try:
            cfg = resolve_hypers(spec, kw)
        except ValueError:  # a require
            continue
        if cfg.combo != tuple(combo):
            continue
        if moved > best_moved:
            best, best_moved = kw, moved
        if moved == len(spec.hypers):
            break
    return best


def default_combo(spec: ir.Spec) -> Combo:
    """The combination of every flag at its default and each derived flag false (a hyperparameter at its
    default, as rmsprop's `momentum = 0`, typically leaves it off)."""
    derived = {d.name for d in spec.derived}
    defaults = {f.name: f.default for f in spec.flags}
    return tuple((name, False if name in derived else defaults[name]) for name, _ in combinations(spec)[0])


def all_on_combo(spec: ir.Spec) -> Combo:
    return tuple((name, True) for name, _ in combinations(spec)[0])


def covering_combos(spec: ir.Spec, limit: int = 8) -> list[Combo]:
    """Every flag combination when there are at most `limit`, else a greedy set that covers every pair of
    values of every two flags (the defaults' combination and all-on first)."""
    every = combinations(spec)
    if len(every) <= limit:
        return every
    names = [name for name, _ in every[0]]
    uncovered = {(i, a, j, b) for i, j in itertools.combinations(range(len(names)), 2)
                 for a in (False, True) for b in (False, True)}
    chosen: list[Combo] = []

    def pairs(combo: Combo):
        vals = [v for _, v in combo]
        return {(i, vals[i], j, vals[j]) for i, j in itertools.combinations(range(len(vals)), 2)}

    for combo in (default_combo(spec), all_on_combo(spec)):
        if combo not in chosen:
            chosen.append(combo)
            uncovered -= pairs(combo)
    while uncovered:
        combo = max(every, key=lambda c: len(pairs(c) & uncovered))
        chosen.append(combo)
        uncovered -= pairs(combo)
    return chosen


def combos_for(spec: ir.Spec, quick: bool) -> list[Combo]:
    """The combinations a run covers: quick, the defaults' and all-on (all-off where every flag defaults to
    on); else `covering_combos`, those first."""
    first = list(dict.fromkeys([default_combo(spec), all_on_combo(spec)]))
    if len(first) == 1 and first[0]:
        first.append(tuple((name, False) for name, _ in first[0]))
    if quick:
        return first
    return list(dict.fromkeys(first + covering_combos(spec)))


def problem_seeds(seed: int, *parts: Sequence) -> int:
    """A stable seed for one case from the run's seed and the case's description (not Python's salted hash)."""
    text = repr((seed, *parts)).encode()
    h = 1469598103934665603
    for byte in text:
        h = ((h ^ byte) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h & 0x7FFFFFFF
