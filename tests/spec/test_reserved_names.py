"""Every named parameter of the Python API is a reserved name of the language.

The API takes a spec's keywords as `**hypers` beside its own parameters, so a
hyperparameter or flag named like one of them would be taken by the API (or
crash it).  This inspects the signatures themselves, so a parameter added to
the API later fails here until `checker.API_KEYWORDS` has it too.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import forge_dsl
from forge_dsl.spec import checker
from forge_dsl import kernels
from forge_dsl.spec.checker import check_spec
from forge_dsl.spec.errors import SpecError
from forge_dsl.kernels import foreach
from forge_dsl.spec.parser import parse_spec


def _entry_points():
    points = [kernels.fused_linear_step, kernels.slab_linear_step, kernels.linear_step, kernels.step,
              forge_dsl.init_state, forge_dsl.reference_step, forge_dsl.ForgeOptimizer.__init__]
    points += [getattr(foreach, n) for n in foreach.__all__ if inspect.isfunction(getattr(foreach, n))]
    return points


def _named_parameters():
    names = set()
    for f in _entry_points():
        for p in inspect.signature(f).parameters.values():
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                names.add(p.name)
    return sorted(names)


def test_the_api_has_named_parameters():
    names = _named_parameters()
    assert {"spec", "tf32", "slab_bytes", "state_dtype", "linear_path", "grads"} <= set(names)


@pytest.mark.parametrize("name", _named_parameters())
def test_api_parameter_is_reserved(name):
    assert name in checker.RESERVED_NAMES, f"add '{name}' to checker.API_KEYWORDS"
    # ... and a spec cannot declare it, with a message that says why
    text = f"optimizer demo\nhyper {name} = 1\nupdate {{\n    param = param - {name} * grad\n}}\n"
    with pytest.raises(SpecError) as info:
        check_spec(parse_spec(text, "demo.fopt"))
    message = f"{info.value.message} {info.value.hint}"
    assert name in message
    reasons = ("Python API", "collide with Python", "built in", "keyword of the language")
    assert any(r in message for r in reasons), message


@pytest.mark.parametrize("name", sorted(checker.API_KEYWORDS - checker.COLLIDING_NAMES - set(checker.BUILTIN_VALUES)))
def test_api_keyword_message_names_the_api(name):
    text = f"optimizer demo\nhyper lr = 1\nflag {name} = false\nupdate {{\n    param = where({name}, param, param - lr * grad)\n}}\n"
    with pytest.raises(SpecError, match=f"'{name}' is reserved: it is a keyword of forge_dsl's Python API"):
        check_spec(parse_spec(text, "demo.fopt"))


def test_lr_is_not_reserved():
    check_spec(parse_spec("optimizer demo\nhyper lr = 1\nupdate {\n    param = param - lr * grad\n}\n"))


def _scheduler_written_keys() -> set[str]:
    """The param-group keys torch.optim's schedulers and SWA write, read from their source."""
    import torch.optim

    root = Path(torch.optim.__file__).parent
    keys = set()
    for module in ("lr_scheduler.py", "swa_utils.py"):
        text = (root / module).read_text()
        keys |= set(re.findall(r"""group\[\s*["'](\w+)["']\s*\]\s*=""", text))
        keys |= set(re.findall(r"""group\.setdefault\(\s*["'](\w+)["']""", text))
    return keys


def test_every_key_a_scheduler_writes_is_reserved_or_scheduled_on_purpose():
    """A spec hyperparameter named like a key torch's schedulers write (initial_lr, max_lr, ...) was silently
    replaced by the scheduler's value (LambdaLR moved lr through initial_lr; OneCycleLR's max_lr became 3.0)."""
    written = _scheduler_written_keys()
    assert {"initial_lr", "max_lr", "swa_lr"} <= written, written  # the source was read
    scheduled = {"lr", "momentum", "betas"}  # what schedulers are for: a spec's lr is meant to follow them
    assert written - scheduled <= checker.RESERVED_NAMES, written - scheduled - checker.RESERVED_NAMES


@pytest.mark.parametrize("name", sorted(checker.SCHEDULER_KEYS))
def test_scheduler_key_is_refused_saying_why(name):
    text = f"optimizer demo\nhyper {name} = 0.5\nupdate {{\n    param = param - {name} * grad\n}}\n"
    with pytest.raises(SpecError, match=f"'{name}' is reserved: torch's learning-rate schedulers"):
        check_spec(parse_spec(text, "demo.fopt"))
