"""Which cases a spec's check runs, running them, and what is reported: the table and a reproducer.

`check_spec_kernels(spec, quick=...)` covers, for each flag combination of `problems.combos_for` (with
keywords from `problems.draw_keywords` and a learning rate that moves the weight by a few percent a
step): fp32 chains on the fused, slab and element-wise paths; per-step checks of every state layout
(fp32, bf16, int8, int4, a mixed dict) with fp32 weights and bf16 weights under both roundings, on those
paths and the fused kernel's other tile configs (the warp-specialized ones on a Hopper GPU); and
shapes with a dimension of 1 and 1-D / 3-D parameters on the element-wise path. `quick` keeps two
combinations (the defaults' and all flags on), int8 and int4 beside fp32, and fewer steps, on every path.
With `against="MODULE:CLASS"` it also runs the reference step against that class for every
combination (`check_reference` alone: no kernels).
"""

from __future__ import annotations

import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence, Union

import torch

from ..api import SpecLike, builtin_names, init_state, load_spec
from ..reference import reference_step
from ..spec import ir
from ..spec.variants import Combo, describe_combo
from .cases import PHASE_MARK, WS_EPILOGUES, Case, CaseResult, load_case_spec, run_case
from .problems import combos_for, draw_keywords, make_problem, problem_seeds

__all__ = ["Report", "check_spec_kernels", "check_reference", "plan_kernel_cases", "plan_reference_cases",
           "format_table", "reproducer", "DEFAULT_STEPS", "QUICK_STEPS", "UPDATE_BAND"]

DEFAULT_STEPS = 8  # enough for step-dependent branches (RAdam's rectification from step 6 at beta2 = 0.999)
QUICK_STEPS = 4
UPDATE_BAND = (0.005, 0.03)  # ‖Δw‖ / ‖w‖ per step that the drawn learning rate is scaled into
LAYOUTS = ("fp32", "bf16", "int8", "int4", "mixed")
WEIGHTS = (("fp32", "stochastic"), ("bf16", "stochastic"), ("bf16", "nearest"))
AWKWARD_SHAPES = ((1, 70), (33, 1))  # a dimension of 1, neither a multiple of a block (every path)
STEP_SHAPES = ((2, 3, 70), (70,))  # a 3-D and a 1-D parameter (element-wise path)


@dataclass
class Report:
    """The results of one run.

    Attributes:
        rows: one `CaseResult` per case, in the order they ran.
        seconds: the run's wall time.
    """

    rows: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    @property
    def failures(self) -> list:
        return [r for r in self.rows if not r.ok]

    @property
    def first_failure(self) -> Optional[CaseResult]:
        return next((r for r in self.rows if not r.ok), None)

    @property
    def reproducer(self) -> Optional[str]:
        first = self.first_failure
        return None if first is None else reproducer(first)

    def table(self) -> str:
        return format_table(self.rows)

    def extend(self, other: "Report") -> None:
        self.rows.extend(other.rows)
        self.seconds += other.seconds


def _spec_ref(spec: SpecLike) -> tuple[ir.Spec, str]:
    """(the loaded spec, how a case names it: a built-in name, or an absolute path to its file; either followed by
    '#tile' or '#post' for a phase, `cases.load_case_spec`)."""
    if isinstance(spec, str):
        base, mark, phase = spec.rpartition(PHASE_MARK)
        if mark and phase in ("tile", "post"):  # a phase: named by its spec's name or absolute path, then '#phase'
            return load_case_spec(spec), (os.path.abspath(base) if Path(base).is_file() else base) + mark + phase
    loaded = load_spec(spec)
    if isinstance(spec, ir.Spec):
        if Path(spec.path).is_file():
            return loaded, os.path.abspath(spec.path)
        if spec.name in builtin_names():
            return loaded, spec.name
        raise ValueError(f"spec {spec.name!r} has no file to rerun it from ({spec.path}); pass its path or name")
    text = os.fspath(spec)
    return loaded, (os.path.abspath(text) if Path(text).is_file() else text)


# ----------------------------------------------------------------------------
# Keywords
# ----------------------------------------------------------------------------


def keywords_for(spec: ir.Spec, combo: Combo, seed: int) -> Optional[dict]:
    """`draw_keywords` for one combination (seeded by the run's seed, the spec and the combination), with the
    learning rate scaled so that the reference moves the weight by `UPDATE_BAND` per step; None where no
    keywords reach the combination."""
    rng = random.Random(problem_seeds(seed, spec.name, combo))
    kw = draw_keywords(spec, combo, rng)
    if kw is None or "lr" not in kw:
        return kw
    lr_hyper = next(h for h in spec.hypers if h.name == "lr")
    target = math.exp(rng.uniform(*map(math.log, UPDATE_BAND)))
    w0 = make_problem(problem_seeds(seed, spec.name, "lr"), torch.float32, device=torch.device("cpu"))[0].double()
    for _ in range(6):
        ratio = _update_ratio(spec, kw, w0)
        if not math.isfinite(ratio) or ratio == 0 or UPDATE_BAND[0] <= ratio <= UPDATE_BAND[1]:
            break
        lr = kw["lr"] * target / ratio
        if not lr_hyper.interval.contains(lr):
            break
        kw = {**kw, "lr": lr}
    return kw


def _update_ratio(spec: ir.Spec, kw: dict, w0: torch.Tensor, steps: int = 3) -> float:
    """The largest ‖Δw‖ / ‖w‖ of the reference's first `steps` steps on w0 [N, K], from dW = dyᵀx of
    `make_problem`'s scale."""
    w = w0.clone()
    state = init_state(spec, w, **kw)
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for step in range(1, steps + 1):
        x = torch.randn(40, w.shape[1], generator=gen, dtype=torch.float64)
        dy = torch.randn(40, w.shape[0], generator=gen, dtype=torch.float64) * 0.1
        before = w.clone()
        reference_step(spec, w, dy.T @ x, state, step=step, **kw)
        worst = max(worst, ((w - before).norm() / before.norm()).item())
    return worst


# ----------------------------------------------------------------------------
# Plans
# ----------------------------------------------------------------------------


def _flags_label(combo: Combo) -> str:
    on = [name for name, value in combo if value]
    return ",".join(on) if on else "-"


def plan_kernel_cases(spec: SpecLike, *, quick: bool = False, steps: Optional[int] = None, device=None,
                      seed: int = 0) -> Iterator[Union[Case, CaseResult]]:
    """The kernel cases of one spec (see the module docstring), in the order they run; a flag combination no
    keywords reach comes as a passed `CaseResult` that says so."""
    loaded, ref = _spec_ref(spec)
    device = torch.device(device) if device is not None else _default_device()
    steps = steps or (QUICK_STEPS if quick else DEFAULT_STEPS)
    from ..kernels import policy

    hopper = policy.hopper_with_gluon(device)
    ws_paths = (["ws"] if quick else list(WS_EPILOGUES)) if hopper else []
    base = Case(spec=ref, path="fused", steps=steps, device=str(device))
    for index, combo in enumerate(combos_for(loaded, quick)):
        kw = keywords_for(loaded, combo, seed)
        label = describe_combo(combo) or "-"
        if kw is None:
            yield CaseResult(base.replace(path="-", combo=label), True,
                             note=f"no keywords reach the flag combination {label}: skipped")
            continue
        c = base.replace(keywords=kw, combo=label)
        cases = []
        for path in ("fused", "slab", "step"):
            cases.append(c.replace(path=path, check="chain"))
        if quick:
            if index == 0:
                for layout, weights, rounding in (("int8", "bf16", "stochastic"), ("mixed", "bf16", "stochastic"),
                                                  ("bf16", "bf16", "nearest"), ("int4", "fp32", "stochastic")):
                    cases += [c.replace(path=p, layout=layout, weights=weights, rounding=rounding)
                              for p in ("fused", "slab", "step", *ws_paths)]
                cases += [c.replace(path="step", layout="int8", weights="bf16", shape=(1, 70), grad="bf16"),
                          c.replace(path="step", layout="bf16", shape=(33, 1)),
                          c.replace(path="fused", check="chain", shape=(1, 70)),
                          c.replace(path="slab", check="chain", shape=(33, 1))]
            else:
                for layout, weights in (("int8", "fp32"), ("mixed", "bf16")):
                    cases += [c.replace(path=p, layout=layout, weights=weights) for p in ("fused", "slab", "step")]
        else:
            if index <= 1:
                paths = ("fused", "halves", "split", "slab", "step") if index == 0 else ("fused", "slab", "step")
                for layout in LAYOUTS:
                    for weights, rounding in WEIGHTS:
                        for p in (*paths, *(ws_paths if index == 0 else ws_paths[:1])):
                            cases.append(c.replace(path=p, layout=layout, weights=weights, rounding=rounding))
                for shape in AWKWARD_SHAPES:
                    for p in ("fused", "slab", "step"):
                        cases += [c.replace(path=p, check="chain", shape=shape),
                                  c.replace(path=p, layout="int8", weights="bf16", shape=shape),
                                  c.replace(path=p, layout="mixed", weights="bf16", rounding="nearest", shape=shape)]
                for shape in STEP_SHAPES:
                    cases += [c.replace(path="step", layout="int8", weights="bf16", grad="bf16", shape=shape),
                              c.replace(path="step", layout="mixed", shape=shape)]
            else:
                for layout, weights, rounding in (("int8", "bf16", "stochastic"), ("mixed", "bf16", "nearest"),
                                                  ("bf16", "fp32", "stochastic")):
                    for p in ("fused", "slab", "step", *ws_paths[:1]):
                        cases.append(c.replace(path=p, layout=layout, weights=weights, rounding=rounding))
        for case in cases:
            yield case.replace(seed=problem_seeds(seed, case.path, case.check, case.layout_label(), case.weights,
                                                  case.rounding, case.shape, label))


def plan_reference_cases(spec: SpecLike, against: str, *, steps: Optional[int] = None,
                         seed: int = 0) -> Iterator[Union[Case, CaseResult]]:
    """One "against" case per flag combination (a covering set where there are many), shape 9 × 13."""
    loaded, ref = _spec_ref(spec)
    steps = steps or DEFAULT_STEPS
    for combo in combos_for(loaded, quick=False):
        label = describe_combo(combo) or "-"
        kw = keywords_for(loaded, combo, seed)
        case = Case(spec=ref, path="against", check="against", against=against, shape=(9, 13), steps=steps,
                    combo=label, seed=problem_seeds(seed, "against", label))
        if kw is None:
            yield CaseResult(case, True, note=f"no keywords reach the flag combination {label}: skipped")
        else:
            yield case.replace(keywords=kw)


def _default_device() -> torch.device:
    from .problems import default_device

    return default_device()


def _run(plan, progress: Optional[Callable[[CaseResult], None]]) -> Report:
    start = time.perf_counter()
    report = Report()
    for item in plan:
        result = item if isinstance(item, CaseResult) else run_case(item)
        report.rows.append(result)
        if progress is not None:
            progress(result)
    report.seconds = time.perf_counter() - start
    return report


def check_spec_kernels(spec: SpecLike, *, quick: bool = False, steps: Optional[int] = None, device=None,
                       seed: int = 0, against: Optional[str] = None,
                       progress: Optional[Callable[[CaseResult], None]] = None) -> Report:
    """Property-test one spec's generated kernels against its float64 reference step (and, with `against`,
    the reference against that "MODULE:CLASS"); see the module docstring.

    Args:
        spec: a built-in name, a path to a `.fopt`, or a loaded spec that has a file.
        quick: the smoke version (about a minute per spec in the Triton interpreter).
        steps: steps per case (default `DEFAULT_STEPS`, `QUICK_STEPS` with quick).
        device: "cpu" (the Triton interpreter, which must be on) or "cuda"; default CUDA when there is one.
        seed: every draw (keywords, data, rounding) follows from it.
        against: e.g. "torch.optim:AdamW".
        progress: called with each result as it comes.

    Returns:
        Report: `.ok`, `.rows`, `.first_failure`, `.reproducer`, `.table()`.
    """
    report = _run(plan_kernel_cases(spec, quick=quick, steps=steps, device=device, seed=seed), progress)
    if against is not None:
        report.extend(check_reference(spec, against, steps=steps, seed=seed, progress=progress))
    return report


def check_reference(spec: SpecLike, against: str, *, steps: Optional[int] = None, seed: int = 0,
                    progress: Optional[Callable[[CaseResult], None]] = None) -> Report:
    """The spec's float64 reference step against a torch.optim-style class "MODULE:CLASS" built with the spec's
    keywords (1:1), every flag combination, float64 parameter and fresh random gradients each step."""
    return _run(plan_reference_cases(spec, against, steps=steps, seed=seed), progress)


# ----------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------


def _spec_label(case: Case) -> str:
    return Path(case.spec).stem if case.spec.endswith(".fopt") else case.spec


def _row(r: CaseResult) -> list[str]:
    c = r.case
    verdict = "skip" if r.note.endswith("skipped") else ("ok" if r.ok else "FAIL")
    shape = "×".join(str(s) for s in c.shape)
    if c.path == "against":
        path, layout, weights = f"vs {c.against}", "-", "fp64"
    else:
        path, layout, weights = c.path, c.layout_label() if c.layout != "mixed" else "mixed", c.weights_label()
    flags = c.combo if c.combo in ("", "-") else ",".join(p.split("=")[0] for p in c.combo.split(", ")
                                                            if p.endswith("=true")) or "-"
    err = "-" if math.isnan(r.error) else f"{r.error:.2e}"
    bnd = "-" if math.isnan(r.bound) else f"{r.bound:.2e}"
    return [_spec_label(c), path, c.check, flags, layout, weights, shape, err, bnd, verdict]


def format_table(rows: Sequence[CaseResult]) -> str:
    """One line per case: spec, path, check, flags on, layout, weights, shape, worst error, bound, verdict."""
    header = ["spec", "path", "check", "flags on", "layout", "weights", "shape", "worst error", "bound", "verdict"]
    table = [header] + [_row(r) for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def reproducer(result: CaseResult) -> str:
    """What failed, and Python lines that rerun it (up to the failing step)."""
    c = result.case
    if result.step is not None:
        c = c.replace(steps=result.step)
    keywords = ", ".join(f"{k}={v!r}" for k, v in c.keywords.items()) or "(defaults)"
    lines = [
        f"first failure: {result.where}" + (f" at step {result.step}" if result.step is not None else ""),
        f"  error {result.error:.6e}, bound {result.bound:.6e}",
        f"  spec        {c.spec}",
        f"  flags       {c.combo or '-'}",
        f"  keywords    {keywords}",
    ]
    if c.path == "against":
        lines.append(f"  against     {c.against}, param shape {tuple(c.shape)}, seed {c.seed}, steps 1..{c.steps}")
    else:
        lines += [f"  path        {c.path} ({c.check}), layout {c.layout_label()}, weights {c.weights_label()}",
                  f"  shape       weight {tuple(c.shape)}, tokens {c.tokens}, seed {c.seed}, steps 1..{c.steps}, "
                  f"device {c.device}"]
    lines += ["rerun:", "```python"]
    if c.device == "cpu" and c.path != "against":
        lines.append('import os; os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported')
    lines += ["from forge_dsl.testing import Case, run_case",
              f"case = {c.source()}",
              "result = run_case(case)",
              "print(result.describe())  # FAIL while the bug is there",
              "```"]
    return "\n".join(lines)
