"""One check of one spec: a `Case` (everything that decides what runs) and `run_case`, which runs it.

A case is one path (the fused kernel under a tile config, the slab path, the element-wise step, or a
torch.optim-style class for the reference step), one state layout, one weight dtype and rounding, one
shape, a number of steps, a seed and the torch-style keywords. Everything it draws is a function of
its fields, so a case that failed reruns the same way from its `repr` (see `reproducer`).

Three kinds of check (`Case.check`):
  * "chain": fp32 weights and fp32 state through `steps` steps without re-synchronising; after each
    step ‖kernel − reference‖ / ‖reference‖ ≤ `FP32_REL_TOL` for the weight and every state, scalar
    states within 1e-12 relative; and each step's update as in "per-step".
  * "per-step": each step from the kernel's own previous (dequantized) values; every element of the
    weight and of every state within its `bound` / `weight_bound` of the float64 reference, and the
    weight's update (w_after − w_before) within `update_bound` of the reference's, both from the same
    weight; with stochastic rounding the mean rounding error along the update over every element of
    every step within `RoundingMean`'s bound.
  * "against": the float64 reference step against `Case.against` built with the same keywords
    (float64 parameter and gradients, fresh random gradients each step), relative error ≤ 1e-10.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..api import init_state, load_spec
from ..kernels.layouts import is_quantized
from ..reference import reference_step
from ..spec import ir
from ..spec.phases import plan
from .bounds import (
    FP32_REL_TOL,
    RoundingMean,
    as_float64_state,
    bound,
    dw_error_bound,
    layout_code,
    rel_err,
    sign_tie_allowance,
    update_bound,
    update_slack,
    weight_bound,
)
from .problems import K, N, T, default_device, layout_for, make_problem

__all__ = ["Case", "CaseResult", "run_case", "load_against", "AGAINST_REL_TOL", "SCALAR_REL_TOL", "SLAB_ROWS",
           "FUSED_PATHS", "LINEAR_PATHS", "PATHS", "HALVES_CONFIG", "SPLIT_CONFIGS", "WS_CONFIG", "WS_EPILOGUES",
           "fused_config_of"]

AGAINST_REL_TOL = 1e-10  # reference step against a torch.optim-style class, both in float64
SCALAR_REL_TOL = 1e-12  # scalar states (float64 on the host in the kernels too)
SLAB_ROWS = 20  # the slab path's slabs in a case: 20 rows, so 72 rows end in a ragged slab of 12


def _tile_configs():
    from ..kernels.policy import TileConfig

    # The fused kernel's other epilogues, with the activations read through TMA descriptors and 32-token
    # blocks (T = 40 takes two, the second ragged): the tile accumulated as two column halves and updated
    # one half at a time; the whole tile accumulated, split in registers and updated a quarter at a time
    # (int8 state: a half, its slices must hold whole 64-element scale blocks).
    halves = TileConfig(32, 64, 128, num_warps=4, num_stages=1, k_halves=True, tma=True)
    split = {q: TileConfig(32, 64, 128, num_warps=4, num_stages=1, tma=True, epilogue_split=2 if q else 4)
             for q in (False, True)}
    # The warp-specialized kernel (Hopper GPUs only: Gluon has no interpreter), with 4 MMA warps, 4 epilogue
    # warps on 32-row slices and 32-token blocks: one program per tile here (72 × 136 is two ragged tiles).
    ws = TileConfig(32, 128, 128, num_warps=4, num_stages=2, tma=True, epilogue_split=4, mma_warps=4)
    # who updates the tiles: the epilogue warps with / without the next slice's prefetch; the MMA warps 1 or 3 of
    # 4 slices (at N = 72 the last slice is all rows past N: U = 1 checks the hand-over with two readers, U = 3
    # the MMA warps' own update)
    epilogues = {"ws": ws, "ws-no-prefetch": dataclasses.replace(ws, prefetch=False),
                 "ws-mma-slice": dataclasses.replace(ws, mma_slices=1),
                 "ws-mma-3-slices": dataclasses.replace(ws, mma_slices=3, prefetch=False)}
    return halves, split, ws, epilogues


HALVES_CONFIG, SPLIT_CONFIGS, WS_CONFIG, WS_EPILOGUES = _tile_configs()
FUSED_PATHS = ("fused", "halves", "split", *WS_EPILOGUES)  # fused_linear_step under each config
LINEAR_PATHS = FUSED_PATHS + ("slab",)
PATHS = LINEAR_PATHS + ("step", "against")


def fused_config_of(path: str, quantized: bool):
    """The tile config of a fused path: None (the default, `fused_config`) for "fused"."""
    return {"fused": None, "halves": HALVES_CONFIG, "split": SPLIT_CONFIGS[quantized], **WS_EPILOGUES}[path]


@dataclass(frozen=True)
class Case:
    """One check; see the module docstring.

    Attributes:
        spec: a built-in name or a path to a `.fopt`.
        path: one of `PATHS`: a fused config ("fused", "halves", "split", "ws", ...), "slab", "step", "against".
        keywords: the torch-style keywords of every step (flags included; groups as tuples).
        check: "chain", "per-step" or "against".
        layout: `init_state`'s layout ("fp32", "bf16", "int8", "int4", a dict per state) or "mixed" (`layout_for`).
        weights: "fp32" or "bf16".
        rounding: "stochastic" or "nearest" (bf16 weights).
        shape: the weight's shape: [N, K] on the linear paths, any on "step" and "against".
        tokens: T, the linear layer's tokens.
        grad: the element-wise step's gradient dtype, "fp32" or "bf16".
        activations: "fp32" or "bf16"; default: the weights' dtype ("bf16" on the warp-specialized paths).
        steps: how many steps (1, 2, ...).
        seed: the data's seed (weights, activations, gradients) and the kernels' stochastic-rounding seed.
        device: "cpu" (the Triton interpreter) or "cuda"; default "cuda" when there is a GPU.
        against: "MODULE:CLASS" of a torch.optim-style class, for check "against".
        combo: the flag combination's description (display only).
    """

    spec: str
    path: str
    keywords: dict = field(default_factory=dict)
    check: str = "per-step"
    layout: Any = "fp32"
    weights: str = "fp32"
    rounding: str = "stochastic"
    shape: tuple = (N, K)
    tokens: int = T
    grad: str = "fp32"
    activations: Optional[str] = None
    steps: int = 8
    seed: int = 0
    device: str = field(default_factory=lambda: str(default_device()))
    against: Optional[str] = None
    combo: str = ""

    def replace(self, **changes) -> "Case":
        return dataclasses.replace(self, **changes)

    @property
    def w_dtype(self) -> torch.dtype:
        return _DTYPES[self.weights]

    @property
    def act_dtype(self) -> torch.dtype:
        if self.activations is not None:
            return _DTYPES[self.activations]
        return torch.bfloat16 if self.path.startswith("ws") else self.w_dtype

    def layout_label(self) -> str:
        if isinstance(self.layout, dict):
            return "{" + ", ".join(f"{k}: {v}" for k, v in self.layout.items()) + "}"
        return str(self.layout)

    def weights_label(self) -> str:
        return "fp32" if self.weights == "fp32" else f"bf16/{self.rounding}"

    def source(self) -> str:
        """Python that builds this case (keyword order fixed; floats printed to round-trip exactly)."""
        fields = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                  if getattr(self, f.name) != _DEFAULTS[f.name] or f.name in ("spec", "path")]
        return "Case(" + ", ".join(fields) + ")"


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_DEFAULTS = {f.name: (f.default if f.default is not dataclasses.MISSING else
                      f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
             for f in dataclasses.fields(Case)}


@dataclass
class CaseResult:
    """What one case found.

    Attributes:
        case: the case.
        ok: every step within its bound.
        error, bound: the worst error and its bound: relative (chain, against) or of the worst element
            relative to its own bound (per-step); NaN where the case did not run.
        step: the step of the first failure, else of the worst error.
        where: which tensor ("weight", "state exp_avg (INT8)", ...), or the exception raised.
        note: anything else worth saying (ties excused, a combination no keyword reaches).
    """

    case: Case
    ok: bool
    error: float = float("nan")
    bound: float = float("nan")
    step: Optional[int] = None
    where: str = ""
    note: str = ""

    def describe(self) -> str:
        verdict = "ok" if self.ok else "FAIL"
        at = f" at step {self.step}" if self.step is not None else ""
        return (f"{verdict}: {self.case.spec} {self.case.path} {self.case.layout_label()} {self.case.weights_label()}"
                f"{at}: {self.where} error {self.error:.3e} (bound {self.bound:.3e})"
                + (f"; {self.note}" if self.note else ""))


class _Worst:
    """The worst error seen so far, by its ratio to its bound; the first failure sticks."""

    def __init__(self):
        self.ratio, self.error, self.bound, self.step, self.where, self.failed = -1.0, 0.0, 0.0, None, "", False

    def see(self, error: float, tol: float, step: int, where: str, failed: Optional[bool] = None) -> None:
        if self.failed:
            return
        failed = not error <= tol if failed is None else failed  # NaN fails
        ratio = math.inf if failed else (error / tol if tol > 0 else 0.0)
        if failed or ratio > self.ratio:
            self.ratio, self.error, self.bound, self.step, self.where, self.failed = ratio, error, tol, step, where, failed

    def result(self, case: Case, note: str = "") -> CaseResult:
        return CaseResult(case, not self.failed, self.error, self.bound, self.step, self.where, note)


PHASE_MARK = "#"  # a case's spec "muon#tile": the tile (or post) phase of a spec that runs in phases


def load_case_spec(ref: str) -> ir.Spec:
    """A case's spec: a built-in name or a .fopt path, or either with '#tile' / '#post', that phase of a spec
    that runs in phases (`spec.phases.plan`)."""
    base, mark, phase = ref.rpartition(PHASE_MARK)
    if mark and phase in ("tile", "post"):
        phases = plan(load_spec(base))
        chosen = phases.tile if phase == "tile" else phases.post
        if chosen is None:
            raise ValueError(f"{base} has no {phase} phase")
        return chosen
    return load_spec(ref)


def run_case(case: Case) -> CaseResult:
    """Run one case (see the module docstring); never raises for what the kernels or the reference do:
    an exception is a failed result that names it."""
    try:
        spec = load_case_spec(case.spec)
        if case.check == "against":
            return _run_against(case, spec)
        if case.check == "chain":
            return _run_chain(case, spec)
        if case.check == "per-step":
            return _run_per_step(case, spec)
        raise ValueError(f"check must be 'chain', 'per-step' or 'against', got {case.check!r}")
    except Exception as err:  # reported, with the case that reruns it
        return CaseResult(case, False, where=f"{type(err).__name__}: {err}")


# ----------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------


def _linear_problem(case: Case):
    """(w, x, dy) for the case: w shaped like the case's weight, x [T, K] and dy [T, N] (N, K: the weight viewed
    as rows); on the case's device."""
    shape = tuple(case.shape)
    k = shape[-1] if shape else 1
    n = math.prod(shape[:-1]) if len(shape) > 1 else 1
    w, x, dy = make_problem(case.seed, case.w_dtype, n=n, k=k, t=case.tokens, act=case.act_dtype,
                            device=torch.device(case.device))
    return w.reshape(shape).contiguous(), x, dy


def _fresh(case: Case, step: int, x: torch.Tensor, dy: torch.Tensor):
    """The activations of `step` (new every step), same shapes and dtypes."""
    gen = torch.Generator().manual_seed(case.seed * 1000 + step)
    x = torch.randn(x.shape, generator=gen).to(x.dtype).to(x.device)
    dy = (torch.randn(dy.shape, generator=gen) * 0.1).to(dy.dtype).to(dy.device)
    return x, dy


def _slab_bytes(case: Case, x: torch.Tensor) -> int:
    return SLAB_ROWS * x.shape[-1] * x.element_size()


def _exact_dw(case: Case, x: torch.Tensor, dy: torch.Tensor, w_shape) -> torch.Tensor:
    """The dW the kernel is meant to step on, float64 on the CPU, shaped like the weight: dyᵀx in float64,
    except on the slab path with bf16 activations, whose dW is a bf16 product like autograd's (the same
    GEMMs, slab by slab)."""
    if case.path == "slab" and x.dtype == torch.bfloat16:
        from ..kernels.policy import slab_rows

        n = dy.shape[1]
        rows = slab_rows(n, x.shape[1], x.element_size(), _slab_bytes(case, x))
        dw = torch.cat([dy[:, r0:r0 + rows].T @ x for r0 in range(0, n, rows)]).double().cpu()
    else:
        dw = dy.double().cpu().T @ x.double().cpu()
    return dw.reshape(w_shape)


def _quantized_layout(layout) -> bool:
    if isinstance(layout, dict):
        return "int8" in layout.values() or "int4" in layout.values()
    return layout in ("int8", "int4", "mixed")


def _run_kernel(case: Case, spec: ir.Spec, x, dy, w, state, grad, step: int) -> None:
    from .. import kernels

    kw = case.keywords
    if case.path == "slab":
        kernels.slab_linear_step(spec, x, dy, w, state, step=step, seed=case.seed, rounding=case.rounding,
                                 slab_bytes=_slab_bytes(case, x), **kw)
    elif case.path == "step":
        kernels.step(spec, w, grad, state, step=step, seed=case.seed, rounding=case.rounding, **kw)
    elif case.path in FUSED_PATHS:
        config = fused_config_of(case.path, _quantized_layout(case.layout))
        kernels.fused_linear_step(spec, x, dy, w, state, step=step, seed=case.seed, rounding=case.rounding,
                                  config=config, **kw)
    else:
        raise ValueError(f"path must be one of {', '.join(PATHS)}, got {case.path!r}")


def _kernel_grad(case: Case, dw: torch.Tensor, device) -> Optional[torch.Tensor]:
    """The materialized gradient of the element-wise path (in the case's grad dtype), else None."""
    if case.path != "step":
        return None
    return dw.to(_DTYPES[case.grad]).to(device).contiguous()


# ----------------------------------------------------------------------------
# The three checks
# ----------------------------------------------------------------------------


def _run_chain(case: Case, spec: ir.Spec) -> CaseResult:
    if case.weights != "fp32" or case.layout != "fp32":
        raise ValueError("a chain case runs fp32 weights and fp32 state; use check='per-step' for the others")
    kw = case.keywords
    w, x, dy = _linear_problem(case)
    ref_w = w.double().cpu()
    ref_state = init_state(spec, ref_w, **kw)
    state = init_state(spec, w, layout="fp32", **kw)
    worst = _Worst()
    for step in range(1, case.steps + 1):
        x, dy = _fresh(case, step, x, dy)
        dw = _exact_dw(case, x, dy, w.shape)
        grad = _kernel_grad(case, dw, w.device)
        one = _one_step_reference(case, spec, w, state, grad.double().cpu() if grad is not None else dw, x, dy, step)
        _run_kernel(case, spec, x, dy, w, state, grad, step)
        reference_step(spec, ref_w, dw, ref_state, step=step, **kw)
        _elementwise(worst, w, one.ref_w, one.update_bound(case), step, "weight update")
        worst.see(rel_err(w, ref_w), FP32_REL_TOL, step, "weight")
        for s in spec.states:
            if s.name in ref_state:
                worst.see(rel_err(state[s.name], ref_state[s.name]), FP32_REL_TOL, step, f"state {s.name}")
        for s in spec.scalars:
            got, ref = float(state[s.name]), float(ref_state[s.name])
            worst.see(abs(got - ref) / max(abs(ref), 1.0), SCALAR_REL_TOL, step, f"scalar {s.name}")
        if worst.failed:
            break
    return worst.result(case)


def _elementwise(worst: _Worst, got: torch.Tensor, ref: torch.Tensor, tol: torch.Tensor, step: int, where: str,
                 tie: Optional[float] = None) -> int:
    """Compare element by element (NaN only where the reference has NaN); returns the ties excused."""
    got, ref = got.double().cpu(), ref.double().cpu()
    both_nan = torch.isnan(got) & torch.isnan(ref)
    err = torch.where(both_nan, torch.zeros_like(got), (got - ref).abs())
    err = torch.where(torch.isnan(err), torch.full_like(err, math.inf), err)
    beyond = err > tol
    ties = 0
    if tie is not None:
        tied = beyond & (err <= tie + tol)
        ties = int(tied.sum())
        if ties > max(2, tied.numel() // 1000):
            worst.see(float("inf"), 0.0, step, f"{where}: {ties} sign ties (at most {max(2, tied.numel() // 1000)})",
                      failed=True)
            return ties
        beyond &= ~tied
        err = torch.where(tied, torch.zeros_like(err), err)
    if err.numel() == 0:
        return ties
    ratio = err / tol.clamp_min(1e-300)
    i = int(torch.argmax(torch.where(torch.isnan(ratio), torch.full_like(ratio, math.inf), ratio)))
    e, b = float(err.flatten()[i]), float(tol.flatten()[i])
    if beyond.any():
        j = int(torch.argmax((err - tol).flatten()))
        count = int(beyond.sum())
        e, b = float(err.flatten()[j]), float(tol.flatten()[j])
        worst.see(e, b, step, f"{where}: {count} of {err.numel()} elements beyond their bound", failed=True)
    else:
        worst.see(e, b, step, where, failed=False)
    return ties


@dataclass
class _OneStep:
    """The reference's step from the kernel's current values: the weight before it [the weight's shape], the
    reference's weight and state after it (float64 CPU), and `update_slack` (with the dW's spread)."""

    w_before: torch.Tensor
    ref_w: torch.Tensor
    ref_state: dict
    slack: torch.Tensor
    spread: Optional[torch.Tensor]

    def update_bound(self, case: Case) -> torch.Tensor:
        return update_bound(self.w_before, self.ref_w, case.w_dtype, case.rounding, self.spread)


def _one_step_reference(case: Case, spec: ir.Spec, w, state, dw: torch.Tensor, x, dy, step: int) -> _OneStep:
    """The reference step from the kernel's own current weight and (dequantized) state on `dw` (float64, the
    weight's shape); on the fused and slab paths, which compute dW in fp32, also on dW ± `dw_error_bound`: the
    largest move of the reference's weight is the update's `spread`."""
    kw = case.keywords
    w_before = w.double().cpu()
    state_before = as_float64_state(state, spec)
    ref_w, ref_state = w_before.clone(), {k: v.clone() for k, v in state_before.items()}
    reference_step(spec, ref_w, dw, ref_state, step=step, **kw)
    spread = None
    if case.path != "step":
        delta = dw_error_bound(dy, x).reshape(dw.shape)
        spread = torch.zeros_like(ref_w)
        for sign in (1.0, -1.0):
            moved, moved_state = w_before.clone(), {k: v.clone() for k, v in state_before.items()}
            reference_step(spec, moved, dw + sign * delta, moved_state, step=step, **kw)
            spread = torch.maximum(spread, (moved - ref_w).abs())
    return _OneStep(w_before, ref_w, ref_state, update_slack(w_before, ref_w, spread), spread)


def _run_per_step(case: Case, spec: ir.Spec) -> CaseResult:
    kw = case.keywords
    w, x, dy = _linear_problem(case)
    state = init_state(spec, w, layout=layout_for(spec, case.layout), **kw)
    tie = sign_tie_allowance(spec, kw, x.dtype, case.path)
    worst = _Worst()
    ties = 0
    mean = RoundingMean() if case.weights == "bf16" and case.rounding == "stochastic" else None
    for step in range(1, case.steps + 1):
        # Reference from the kernel's own current values, in float64.
        dw = _exact_dw(case, x, dy, w.shape)
        grad = _kernel_grad(case, dw, w.device)
        if grad is not None:
            dw = grad.double().cpu()  # the element-wise kernel steps on the gradient as it reads it
        one = _one_step_reference(case, spec, w, state, dw, x, dy, step)
        ref_w, ref_state = one.ref_w, one.ref_state
        _run_kernel(case, spec, x, dy, w, state, grad, step)
        ties += _elementwise(worst, w, ref_w, weight_bound(ref_w, case.w_dtype, case.rounding), step, "weight", tie)
        tol = one.update_bound(case)
        _elementwise(worst, w, ref_w, tol, step, "weight update", tie)
        if mean is not None:
            got = w.double().cpu()
            err = (got - ref_w).abs()
            mean.add(one.w_before, ref_w, got, one.slack,
                     keep=None if tie is None else ~((err > tol) & (err <= tie + tol)))  # excused ties left out
            if step == case.steps:
                worst.see(mean.statistic, mean.bound, step,
                          f"weight update: mean stochastic rounding error along it, in ulps, over {mean.n} elements")
        got_state = as_float64_state(state, spec)
        for s in spec.states:
            if s.name not in state:
                continue
            got, ref = got_state[s.name], ref_state[s.name]
            scale = state.get(f"{s.name}.scale")
            lay = layout_code(state[s.name], scale)
            tol = bound(lay, ref, got if is_quantized(lay) else ref, scale)
            _elementwise(worst, got, ref, tol, step, f"state {s.name} ({lay.name})")
        for s in spec.scalars:
            got, ref = float(state[s.name]), float(ref_state[s.name])
            worst.see(abs(got - ref) / max(abs(ref), 1.0), SCALAR_REL_TOL, step, f"scalar {s.name}")
        if worst.failed:
            break
        x, dy = _fresh(case, step, x, dy)
    return worst.result(case, f"{ties} sign ties excused" if ties else "")


def load_against(target: str):
    """The class named by "MODULE:CLASS" (e.g. "torch.optim:Adam"). Raises ValueError saying what is wrong."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--against takes MODULE:CLASS, e.g. torch.optim:AdamW, got {target!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"--against {target}: cannot import {module_name!r} ({err})") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"--against {target}: {module_name} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"--against {target}: {attr!r} is not a class")
    return obj


def _run_against(case: Case, spec: ir.Spec) -> CaseResult:
    cls = load_against(case.against)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # torch keeps scalar state (step, NAdam's mu_product) in it
    try:
        return _against(case, spec, cls)
    finally:
        torch.set_default_dtype(previous)


def _against(case: Case, spec: ir.Spec, cls) -> CaseResult:
    kw = case.keywords
    gen = torch.Generator().manual_seed(case.seed)
    p0 = torch.randn(case.shape, generator=gen, dtype=torch.float64)
    ours = p0.clone()
    theirs = p0.clone().requires_grad_(True)
    try:
        opt = cls([theirs], **kw)
    except TypeError as err:
        return CaseResult(case, False, where=f"{case.against}(params, **keywords) refused the spec's keywords: {err}")
    state = init_state(spec, ours, **kw)
    names = [*spec.state_names, *spec.scalar_names]
    worst = _Worst()
    for step in range(1, case.steps + 1):
        grad = torch.randn(case.shape, generator=gen, dtype=torch.float64) * (0.1 + step)
        reference_step(spec, ours, grad, state, step=step, **kw)
        theirs.grad = grad.clone()
        opt.step()
        with torch.no_grad():
            worst.see(rel_err(ours, theirs.detach()), AGAINST_REL_TOL, step, "param")
            for name in names:
                theirs_state = opt.state[theirs].get(name)
                if theirs_state is not None and name in state:
                    ref = torch.as_tensor(theirs_state, dtype=torch.float64)
                    worst.see(rel_err(state[name].double(), ref), AGAINST_REL_TOL, step, f"state {name}")
        if worst.failed:
            break
    return worst.result(case)
