"""Stage 4 (runtime): torch-style keyword arguments → validated hyperparameter values.

`resolve_hypers(spec, kwargs)` applies defaults, unpacks tuple keywords (torch's
`betas=(0.9, 0.999)` sets the scalar hyperparameters `beta1` and `beta2`; the
members may also be passed by their own names), lets an optional hyperparameter
(`hyper t = none`) be None, its default, checks ranges the way
torch.optim does (a `ValueError` naming the keyword and its range), evaluates
derived flags and `require` checks, and picks the flag combination to run.
`check_step` and `check_seed` validate the two other numbers every step takes.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from . import ir
from .errors import did_you_mean
from .variants import Combo, evaluate, variant_of

__all__ = ["StepConfig", "resolve_hypers", "check_step", "check_seed"]


@dataclass(frozen=True)
class StepConfig:
    """Resolved keywords for one call.

    Attributes:
        hypers: every real hyperparameter by its scalar name (tuple members unpacked); None for an
            optional one (`hyper t = none`) not given, which the update then does not read (the
            checker proves it: only flag combinations with a true `given(t)` flag read it).
        flags: every flag and derived flag.
        combo: the flag combination, in `variants.combinations` order.
        variant: the compiled variant that runs it (`variants.variant_of`: without the runtime flags).
        host_inputs: what a variant's host program reads by name: `hypers` and the flags (the runtime
            flags' values among them).
        choices: every choice keyword's word (None where its default is none and none was given); only the
            derived flags read them, so the kernels never do.
    """

    hypers: dict[str, Optional[float]]
    flags: dict[str, bool]
    combo: Combo
    variant: Combo = ()
    choices: dict[str, Optional[str]] = field(default_factory=dict)
    host_inputs: dict[str, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # derived once, here, so that dataclasses.replace(cfg, hypers=...) never keeps a stale copy
        object.__setattr__(self, "host_inputs", {**self.hypers, **self.flags})


def _tensor_item(label: str, value: Any, what: str) -> Any:
    """The Python number in a one-element tensor (as torch allows for lr); anything else as it is."""
    if not (hasattr(value, "numel") and hasattr(value, "item")):
        return value
    if value.numel() != 1:
        raise ValueError(f"{label} must be {what}, got a tensor of shape {tuple(value.shape)}")
    if getattr(value, "is_meta", False):
        raise ValueError(f"{label} must be {what}, got a meta tensor (it has no value)")
    return value.item()


def _as_number(spec: ir.Spec, label: str, value: Any) -> float:
    value = _tensor_item(f"{spec.name}: {label}", value, "a number")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{spec.name}: {label} must be a number, got {type(value).__name__} {value!r}")
    try:
        return float(value)
    except OverflowError:  # an int (or Fraction) beyond the largest float
        too_large = f"Invalid {label}: {_short(value)} does not fit a float (the largest is about 1.8e308)"
        raise ValueError(too_large) from None


MAX_STEP = 2**53  # the largest step a float64 holds exactly


def check_step(step: Any) -> int:
    """`step` as an int, or a torch-style error naming it: the 1-based step number of a kernel or reference
    step (an int, an integral float or a one-element tensor holding one).

    Raises:
        TypeError: not a number (None, a string, a bool).
        ValueError: not a positive integer (0, 1.5, inf, nan), or above `MAX_STEP`.
    """
    if type(step) is int and 1 <= step <= MAX_STEP:  # the common case, first: every layer's update checks it
        return step
    value = _tensor_item("step", step, "a positive integer")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"step must be a positive integer (1 for the first step), got {type(step).__name__} {step!r}")
    whole = _integral(value)
    if whole is None or whole < 1:
        raise ValueError(f"step must be a positive integer (1 for the first step), got {_short(step)}")
    if whole > MAX_STEP:
        raise ValueError(f"step must be at most 2**53 (host scalars such as beta1 ** step are float64), "
                         f"got {_short(step)}")
    return whole


def check_seed(seed: Any, label: str = "seed") -> int:
    """`seed` as an int, or a torch-style error naming it (`label`): a stochastic-rounding seed, any integer
    (an integral float or a one-element integer tensor too); the kernels read its low 32 bits.

    Raises:
        TypeError: not a number (None, a string, a bool).
        ValueError: not an integer (1.5, inf, nan).
    """
    if type(seed) is int:
        return seed
    value = _tensor_item(label, seed, "an integer")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{label} must be an integer, got {type(seed).__name__} {seed!r}")
    whole = _integral(value)
    if whole is None:
        raise ValueError(f"{label} must be an integer, got {_short(seed)}")
    return whole


def _integral(value: numbers.Real) -> Optional[int]:
    """`value` as an int where it is a whole number (of any size), else None (1.5, inf, nan)."""
    if isinstance(value, numbers.Integral):
        return int(value)
    try:
        f = float(value)
    except OverflowError:  # a Fraction beyond the largest float
        return None
    return int(f) if math.isfinite(f) and f.is_integer() else None


def _short(value: Any) -> str:
    """`repr(value)`, cut to 60 characters (an int of 400 digits is shown by its length)."""
    text = repr(value)
    if isinstance(value, int) and len(text) > 60:
        return f"an integer of {len(text.lstrip('-'))} digits ({text[:20]}...)"
    return text if len(text) <= 60 else text[:57] + "..."


def resolve_hypers(spec: ir.Spec, kwargs: Mapping[str, Any], caller: str = "step") -> StepConfig:
    """Validate `kwargs` against the spec's declarations; see the module docstring.

    Raises:
        TypeError: an unknown or duplicated keyword, or a required one missing.
        ValueError: a value of the wrong type, outside its range, or failing a `require`.
    """
    groups = {g.name: g for g in spec.groups}
    hypers = {h.name: h for h in spec.hypers}
    flags = {f.name: f for f in spec.flags}
    choices = {c.name: c for c in spec.choices}
    known = list(groups) + list(hypers) + list(flags) + list(choices)
    for key in kwargs:
        if key not in groups and key not in hypers and key not in flags and key not in choices:
            raise TypeError(
                f"{caller}() got an unexpected keyword argument '{key}' for optimizer '{spec.name}'"
                + did_you_mean(key, known)
                + f" (its keywords are: {', '.join(spec.keyword_defaults())})"
            )

    values: dict[str, Optional[float]] = {}
    for g in groups.values():
        if g.name not in kwargs:
            continue
        given = kwargs[g.name]
        if not isinstance(given, (tuple, list)) or len(given) != len(g.members):
            raise ValueError(
                f"{spec.name}: {g.name} must be a tuple of {len(g.members)} numbers "
                f"({', '.join(g.members)}), got {given!r}"
            )
        for i, (member, v) in enumerate(zip(g.members, given)):
            if member in kwargs:
                raise TypeError(f"{caller}() got both '{g.name}' and its member '{member}'; pass one of them")
            values[member] = None if v is None and hypers[member].optional else _as_number(
                spec, f"{g.name}[{i}] ({member})", v)
    for name, h in hypers.items():
        if h.optional and kwargs.get(name) is None and name not in values:
            values[name] = None
        elif name in kwargs:
            values[name] = _as_number(spec, name, kwargs[name])
        elif name not in values:
            if h.default is None:
                raise TypeError(f"{caller}() missing required keyword argument '{name}' for optimizer '{spec.name}'")
            values[name] = h.default
    for name, h in hypers.items():
        v = values[name]
        if v is not None and not h.interval.contains(v):
            label = f"{h.group}[{h.index}] ({name})" if h.group else name
            raise ValueError(f"Invalid {label}: {_show(v)}; {spec.name} expects a value in {h.interval}")

    flag_values: dict[str, bool] = {}
    for name, f in flags.items():
        v = kwargs.get(name, f.default)
        if hasattr(v, "item") and hasattr(v, "numel") and v.numel() == 1:
            v = _tensor_item(f"{spec.name}: {name}", v, "True or False")
        if not isinstance(v, bool):
            raise ValueError(f"{spec.name}: {name} must be True or False, got {v!r}")
        flag_values[name] = v
    scope: dict[str, Any] = dict(values)
    scope.update(flag_values)
    words = {name: _choice(spec, c, kwargs.get(name, c.default)) for name, c in choices.items()}
    scope.update(words)
    for d in spec.derived:
        flag_values[d.name] = bool(evaluate(d.expr, scope))
        scope[d.name] = flag_values[d.name]
    for r in spec.requires:
        if not evaluate(r.condition, scope):
            raise ValueError(f"{spec.name}: {r.message}")
    combo = tuple((f.name, flag_values[f.name]) for f in spec.flags) + tuple(
        (d.name, flag_values[d.name]) for d in spec.derived
    )
    return StepConfig(values, flag_values, combo, variant_of(spec, combo), words)


def _choice(spec: ir.Spec, choice: ir.Choice, value: Any) -> Optional[str]:
    """`value` as a word of `choice` (None where its default is none), or a torch-style ValueError naming it."""
    if value is None and choice.default is None or isinstance(value, str) and value in choice.values:
        return value
    words = ", ".join(repr(w) for w in choice.values) + (" or None" if choice.default is None else "")
    raise ValueError(f"Invalid {choice.name}: {_short(value)}; {spec.name} expects one of {words}"
                     + (did_you_mean(value, choice.values) if isinstance(value, str) else ""))


def _show(v: float) -> str:
    if math.isnan(v) or math.isinf(v):
        return str(v)
    return repr(v)
