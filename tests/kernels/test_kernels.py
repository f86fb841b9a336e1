"""Generated kernels against the reference step, for every spec × layout × weight dtype.

The reference is `forge_dsl.reference_step` in float64 applied to the dW that
PyTorch computes (in float64) from the same X and dY.  On a CPU-only machine
the kernels run in the Triton interpreter; with CUDA the same tests run
compiled on the GPU.

Tolerances follow from what each layout rounds (see `bound`):
  * fp32 weights and fp32 state: only fp32 arithmetic differs; relative error
    (‖a − b‖ / ‖b‖) ≤ 1e-5 after 3 steps, without re-synchronising.
  * quantized layouts: checked one step at a time from the kernel's own
    previous (dequantized) values, element by element: the kernel computes the
    update in fp32 registers and rounds once on store, so each element is
    within the layout's rounding bound of the exact value, plus fp32 slack.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

import forge_dsl
from spec_lists import ELEMENT_WISE
from references import ADAMAX
from tiers import sweep
from forge_dsl import kernels
from forge_dsl.kernels import checks, policy, slabs, steps
from forge_dsl.spec.variants import combinations, describe_combo
from forge_dsl.spec.keywords import resolve_hypers
from forge_dsl.kernels.layouts import StateLayout
from forge_dsl.testing import (FP32_REL_TOL, HALVES_CONFIG, K, N, SPLIT_CONFIGS, T, WS_CONFIG, WS_EPILOGUES,
                               as_float64_state, bf16_ulp, bound, default_device, layout_code, layout_for,
                               make_problem, rel_err, sign_tie_allowance, weight_bound)

DEVICE = default_device()
SPECS = ELEMENT_WISE
HYPERS = {"sgd_momentum": {"momentum": 0.9}, "lion": {"lr": 1e-3}}


def hypers_for(name: str, **extra) -> dict:
    kw = {"lr": 1e-2}
    kw.update(HYPERS.get(name, {}))
    kw.update(extra)
    return kw


# ----------------------------------------------------------------------------
# fp32 weights and state: 3 steps, no re-synchronisation
# ----------------------------------------------------------------------------


# the quick tier: each spec once, the paths in turn
@pytest.mark.parametrize(*sweep(("name", SPECS), ("fused", [True, False, "slab"], ["fused", "step", "slab"])))
def test_fp32_three_steps(name, fused):
    spec = forge_dsl.load_spec(name)
    kw = hypers_for(name)
    w, x, dy = make_problem(1, torch.float32)
    ref_w = w.double().cpu()
    ref_state = forge_dsl.init_state(spec, ref_w, **kw)
    state = forge_dsl.init_state(spec, w, layout="fp32", **kw)
    for step in range(1, 4):
        gen = torch.Generator().manual_seed(100 + step)
        x = torch.randn(x.shape, generator=gen).to(DEVICE)
        dy = (torch.randn(dy.shape, generator=gen) * 0.1).to(DEVICE)
        dw = dy.double().cpu().T @ x.double().cpu()
        if fused == "slab":  # 72 rows of 136 fp32: slabs of 20 rows, the last one ragged
            kernels.slab_linear_step(spec, x, dy, w, state, step=step, slab_bytes=20 * 136 * 4 + 100, **kw)
        elif fused:
            kernels.fused_linear_step(spec, x, dy, w, state, step=step, **kw)
        else:
            kernels.step(spec, w, (dy.T @ x).contiguous(), state, step=step, **kw)
        forge_dsl.reference_step(spec, ref_w, dw, ref_state, step=step, **kw)
    assert rel_err(w, ref_w) <= FP32_REL_TOL
    for s in spec.states:
        if s.name in ref_state:
            assert rel_err(state[s.name], ref_state[s.name]) <= FP32_REL_TOL, s.name
    for s in spec.scalars:
        assert float(state[s.name]) == pytest.approx(float(ref_state[s.name]), rel=1e-12)


VARIANTS = [(name, combo) for name in SPECS for combo in combinations(forge_dsl.load_spec(name))]


@pytest.mark.parametrize("name, combo", VARIANTS, ids=[f"{n}[{describe_combo(c)}]" for n, c in VARIANTS])
def test_every_flag_combination(name, combo):
    """Each generated variant (flag combination) against the reference, fused kernel, fp32."""
    spec = forge_dsl.load_spec(name)
    flags = dict(combo)
    kw = hypers_for(name)
    derived = {d.name for d in spec.derived}
    for flag, value in flags.items():
        if flag in derived:  # rmsprop's has_momentum follows from momentum
            kw["momentum"] = 0.9 if value else 0.0
        else:
            kw[flag] = value
    if kw.get("nesterov"):
        kw["dampening"] = 0.0
    w, x, dy = make_problem(2, torch.float32, n=40, k=70, t=24)
    ref_w = w.double().cpu()
    ref_state = forge_dsl.init_state(spec, ref_w, **kw)
    state = forge_dsl.init_state(spec, w, layout="fp32", **kw)
    for step in range(1, 3):
        kernels.fused_linear_step(spec, x, dy, w, state, step=step, **kw)
        forge_dsl.reference_step(spec, ref_w, dy.double().cpu().T @ x.double().cpu(), ref_state, step=step, **kw)
    assert rel_err(w, ref_w) <= FP32_REL_TOL


# ----------------------------------------------------------------------------
# Every layout × weight dtype: one step at a time, element-wise rounding bounds
# ----------------------------------------------------------------------------


# The fused kernel's other epilogues (HALVES_CONFIG, SPLIT_CONFIGS) and the warp-specialized kernel's configs
# (WS_CONFIG, WS_EPILOGUES): forge_dsl/testing/cases.py, which says what each one exercises.


def hopper_with_gluon() -> bool:
    return policy.hopper_with_gluon(DEVICE)


# The quick tier's share of the 320 cases: each spec, path, layout and weight dtype, the split epilogue with and
# without quantized state, int8 state with bf16 weights on the fused and the step kernel; `pytest -m slow` the rest.
QUICK_LAYOUTS = {"adamw-fused-int8-w_bf16", "adamw-split-fp32-w_fp32", "adagrad-fused-fp32-w_bf16",
                 "lion-step-int8-w_bf16", "nadam-fused-bf16-w_fp32", "radam-split-mixed-w_bf16",
                 "rmsprop-halves-int8-w_fp32", "sgd-step-fp32-w_fp32", "sgd_momentum-slab-mixed-w_fp32",
                 "adamw-slab-bf16-w_bf16"}


@pytest.mark.parametrize(*sweep(("name", SPECS),
                                ("fused", [True, "halves", "split", False, "slab"],
                                 ["fused", "halves", "split", "step", "slab"]),
                                ("layout", ["fp32", "bf16", "int8", "mixed"]),
                                ("w_dtype", [torch.float32, torch.bfloat16], ["w_fp32", "w_bf16"]),
                                quick=QUICK_LAYOUTS))
def test_layouts(name, fused, layout, w_dtype):
    check_layouts(name, fused, layout, w_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16], ids=["w_fp32", "w_bf16"])
@pytest.mark.parametrize("epilogue", list(WS_EPILOGUES))
@pytest.mark.parametrize("layout", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("name", SPECS)
def test_layouts_warp_specialized(name, layout, epilogue, w_dtype):
    """`test_layouts` for the warp-specialized kernel: bf16 activations, fp32 or bf16 weights, fp32, bf16 or
    int8 state (its block scales: Gluon's own offsets, `gluon_lib.ws_slice_offsets`; the ragged 136 columns
    leave a partial last block), with and without the epilogue's prefetch, and with the MMA warps updating
    some of each tile's slices. The refusals are in test_warp_specialized_configs_are_refused_where_they_cannot_run."""
    if not hopper_with_gluon():
        pytest.skip("the warp-specialized kernel runs only compiled on a Hopper GPU (Gluon has no interpreter)")
    check_layouts(name, epilogue, layout, w_dtype, act=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["fp32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("name", SPECS)
def test_reused_launch_writes_the_checked_bits(name, layout, monkeypatch):
    """Eight steps through `linear_step` (fresh activations each step, so RAdam's rectification and
    SGD-momentum's first step switch kernels), reused launches (forge_dsl/kernels/reuse.py) against the
    checked path on a copy: the same bits in the weight and every state tensor after each step."""
    from forge_dsl.kernels import reuse

    if not hopper_with_gluon():
        pytest.skip("the warp-specialized kernel runs only compiled on a Hopper GPU (Gluon has no interpreter)")
    if not reuse.enabled():
        pytest.skip("launches are reused only with the Triton versions in reuse.VERIFIED_TRITON")
    spec = forge_dsl.load_spec(name)
    kw = hypers_for(name)
    w, _, _ = make_problem(21, torch.bfloat16)
    state = forge_dsl.init_state(spec, w, layout=layout, **kw)
    w2, state2 = w.clone(), {k: v.clone() for k, v in state.items()}
    reused = []
    launch_prepared = reuse.PreparedLaunch.launch

    def counted(self, *args):
        scalar_updates = launch_prepared(self, *args)
        reused.append(scalar_updates is not None)
        return scalar_updates

    monkeypatch.setattr(reuse.PreparedLaunch, "launch", counted)
    for step in range(1, 9):
        _, x, dy = make_problem(100 + step, torch.bfloat16)
        monkeypatch.setattr(reuse, "_SUPPORTED", True)
        kernels.linear_step(spec, x, dy, w, state, step=step, seed=3, config=WS_CONFIG, **kw)
        monkeypatch.setattr(reuse, "_SUPPORTED", False)
        kernels.linear_step(spec, x, dy, w2, state2, step=step, seed=3, config=WS_CONFIG, **kw)
        assert torch.equal(w.view(torch.int16), w2.view(torch.int16)), f"step {step}: weights differ"
        for k, v in state.items():
            assert torch.equal(v, state2[k]), f"step {step}: state {k} differs"
    assert sum(reused) >= 6, reused  # all steps but the first and a switch of kernels


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bf16", "int8"])
def test_a_layer_on_another_gpu_than_the_current_one(layout):
    """A layer on cuda:1 while cuda:0 is current (a model split over GPUs): its checked launch, the reused
    ones after it and `step` run on the layer's GPU and write what the same calls write with cuda:1 current."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    spec = forge_dsl.load_spec("adamw")
    w, x, dy = (t.to("cuda:1") for t in make_problem(31, torch.bfloat16))
    state = forge_dsl.init_state(spec, w, layout=layout)
    w2, state2 = w.clone(), {k: v.clone() for k, v in state.items()}
    config = WS_CONFIG if hopper_with_gluon() else None
    for step in range(1, 4):
        assert torch.cuda.current_device() == 0
        kernels.linear_step(spec, x, dy, w, state, step=step, seed=5, config=config, lr=1e-2)
        with torch.cuda.device(1):
            kernels.linear_step(spec, x, dy, w2, state2, step=step, seed=5, config=config, lr=1e-2)
        assert torch.equal(w.view(torch.int16), w2.view(torch.int16)), f"step {step}"
        assert all(torch.equal(v, state2[k]) for k, v in state.items()), f"step {step}"
    g = torch.randn(w.shape, device="cuda:1")
    kernels.step(spec, w, g, state, step=4, lr=1e-2)
    with torch.cuda.device(1):
        kernels.step(spec, w2, g, state2, step=4, lr=1e-2)
    assert torch.equal(w.view(torch.int16), w2.view(torch.int16))


def check_layouts(name, fused, layout, w_dtype, act=None):
    spec = forge_dsl.load_spec(name)
    kw = hypers_for(name)
    w, x, dy = make_problem(3, w_dtype, act=act)
    state = forge_dsl.init_state(spec, w, layout=layout_for(spec, layout), **kw)
    for step in range(1, 4):
        # Reference from the kernel's own current values, in float64.
        ref_w = w.double().cpu()
        ref_state = as_float64_state(state, spec)
        dw = dy.double().cpu().T @ x.double().cpu()
        if fused == "slab" and x.dtype == torch.bfloat16:
            # the slab path's dW is a bf16 product, like autograd's: the same GEMMs, slab by slab (20 rows)
            dw = torch.cat([dy[:, r0:r0 + 20].T @ x for r0 in range(0, dy.shape[1], 20)]).double().cpu()
        forge_dsl.reference_step(spec, ref_w, dw, ref_state, step=step, **kw)
        if fused == "slab":  # slabs of 20 rows, the last one ragged
            slab_bytes = 20 * 136 * x.element_size()
            kernels.slab_linear_step(spec, x, dy, w, state, step=step, seed=7, slab_bytes=slab_bytes, **kw)
        elif fused:
            config = {"halves": HALVES_CONFIG, "split": SPLIT_CONFIGS[layout in ("int8", "int4", "mixed")],
                      **WS_EPILOGUES}.get(fused)
            kernels.fused_linear_step(spec, x, dy, w, state, step=step, seed=7, config=config, **kw)
        else:
            kernels.step(spec, w, dw.float().to(DEVICE), state, step=step, seed=7, **kw)
        got_w = w.double().cpu()
        tol_w = weight_bound(ref_w, w_dtype)  # bf16: stochastic rounding lands on a bf16 neighbour of the exact value
        err = (got_w - ref_w).abs()
        beyond = err > tol_w
        tie_allowance = sign_tie_allowance(spec, kw, x.dtype, "slab" if fused == "slab" else "fused")
        if tie_allowance is not None:
            # A bf16 dW can cancel exactly in Lion's β1·m + (1 − β1)·g (seen on the GPU): the sign of that
            # zero is fp32 vs float64 rounding, and the update flips by 2·lr. Excuse one such tie per 1000.
            tie = beyond & (err <= tie_allowance + tol_w)
            assert tie.sum().item() <= max(2, tie.numel() // 1000), f"step {step}: {tie.sum().item()} sign ties"
            beyond &= ~tie
        assert not beyond.any(), (f"step {step}: {beyond.sum().item()} weights off by up to "
                                  f"{(err - tol_w).max().item():.3e} beyond their bound")
        for s in spec.states:
            if s.name not in state:
                continue
            got = as_float64_state(state, spec)[s.name]
            ref = ref_state[s.name]
            lay = layout_code(state[s.name], state.get(f"{s.name}.scale"))
            tol = bound(lay, ref, got if lay in (StateLayout.INT8, StateLayout.UINT8_SQRT) else ref,
                        state.get(f"{s.name}.scale"))
            excess = ((got - ref).abs() - tol).max().item()
            assert excess <= 0, f"step {step}: state {s.name} ({lay.name}) off by {excess:.3e} beyond its bound"
        # dy/x change every step (fresh data)
        gen = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(x.shape, generator=gen).to(x.dtype).to(DEVICE)
        dy = (torch.randn(dy.shape, generator=gen) * 0.1).to(dy.dtype).to(DEVICE)


# ----------------------------------------------------------------------------
# Stochastic rounding at the kernel level
# ----------------------------------------------------------------------------


def test_stochastic_rounding_keeps_sub_ulp_updates_nearest_loses_them():
    """SGD with lr·g = 1e-4 on weights near 1 (bf16 ulp 2^-7 ≈ 7.8e-3): 40 steps."""
    shape = (64, 256)
    n_steps, delta = 40, 1e-4
    results = {}
    for rounding in ("stochastic", "nearest"):
        w = torch.ones(shape, dtype=torch.bfloat16, device=DEVICE)
        g = torch.full(shape, 1.0, dtype=torch.float32, device=DEVICE)
        state = forge_dsl.init_state("sgd", w, layout="fp32")
        for step in range(1, n_steps + 1):
            kernels.step("sgd", w, g, state, step=step, seed=3, rounding=rounding, lr=delta)
        results[rounding] = w.double().mean().item()
    expected = 1.0 - n_steps * delta
    # Each element: a sum of `n_steps` independent rounding errors, each of variance ≤ ulp²/4
    # (ulp ≤ 2^-7 here); the mean over all elements has std ≤ ulp·sqrt(steps)/2/sqrt(numel).
    std = 2.0**-7 * math.sqrt(n_steps) / 2 / math.sqrt(shape[0] * shape[1])
    assert abs(results["stochastic"] - expected) <= 5 * std, (results, expected, std)
    assert results["nearest"] == 1.0  # every update is below half an ulp: nearest rounding loses all of them


def test_stochastic_rounding_depends_on_seed_step_and_index_only():
    w0 = torch.randn(72, 136).to(torch.bfloat16).to(DEVICE)
    g = torch.randn(72, 136, device=DEVICE)
    outs = []
    for config in [kernels.TileConfig(64, 64, 64, num_warps=4, num_stages=1),
                   kernels.TileConfig(32, 64, 128, num_warps=4, num_stages=1), HALVES_CONFIG, *SPLIT_CONFIGS.values()]:
        w = w0.clone()
        st = forge_dsl.init_state("sgd", w, layout="fp32")
        x = torch.eye(136, device=DEVICE, dtype=torch.bfloat16)[:64]  # T=64 tokens
        dy = torch.zeros(64, 72, device=DEVICE, dtype=torch.bfloat16)
        kernels.fused_linear_step("sgd", x, dy, w, st, step=5, seed=11, config=config, lr=1e-3, weight_decay=0.1)
        outs.append(w.clone())
    for other in outs[1:]:
        assert torch.equal(outs[0].view(torch.int16), other.view(torch.int16))
    w = w0.clone()
    st = forge_dsl.init_state("sgd", w, layout="fp32")
    kernels.step("sgd", w, torch.zeros_like(g), st, step=6, seed=11, lr=1e-3, weight_decay=0.1)
    assert not torch.equal(w.view(torch.int16), outs[0].view(torch.int16))  # another step: other bits


@pytest.mark.parametrize("name", ["adamw", "lion"])
def test_epilogue_slices_change_no_bit(name):
    """The epilogue on the whole tile or on 2 or 4 column slices of it computes the same numbers from
    the same accumulator: every bit of the weights and state agrees."""
    kw = hypers_for(name)
    w0, x, dy = make_problem(5, torch.bfloat16)
    results = {}
    for split in (1, 2, 4):
        config = kernels.TileConfig(32, 64, 128, num_warps=4, num_stages=1, tma=True, epilogue_split=split)
        w = w0.clone()
        state = forge_dsl.init_state(name, w, layout="bf16", **kw)
        for step in (1, 2):
            kernels.fused_linear_step(name, x, dy, w, state, step=step, seed=3, config=config, **kw)
        results[split] = [w.view(torch.int16)] + [state[s].view(torch.int16) for s in sorted(state)
                                                  if state[s].dtype == torch.bfloat16]
    (_, first), *others = results.items()
    assert not torch.equal(first[0], w0.view(torch.int16))  # the steps changed the weights
    for key, tensors in others:
        for got, want in zip(tensors, first):
            assert torch.equal(got, want), f"epilogue_split={key} differs from the unsplit epilogue"


# ----------------------------------------------------------------------------
# Shapes, zero tokens, strides, errors
# ----------------------------------------------------------------------------


def test_tile_configs_are_validated():
    assert kernels.TileConfig(64, 128, 128, k_halves=True).epilogue_split == 2  # halves: one slice per half
    assert kernels.TileConfig(64, 128, 128).epilogue_split == 1
    for bad, message in ((dict(k_halves=True, epilogue_split=1), "k_halves accumulates two column halves"),
                         (dict(epilogue_split=3), "epilogue_split must be 1, 2 or 4"),
                         (dict(maxnreg=300), r"maxnreg must be in \[24, 255\]")):
        with pytest.raises(ValueError, match=message):
            kernels.TileConfig(64, 128, 128, **bad)
    w, x, dy = make_problem(4, torch.bfloat16)
    for layout, config, message in (
            ("int8", kernels.TileConfig(32, 64, 128, epilogue_split=4), "a multiple of 64 for int8 state"),
            ("bf16", kernels.TileConfig(32, 64, 256, epilogue_split=4, num_stages=1), None),  # 64-wide slices: fine
            ("bf16", kernels.TileConfig(32, 64, 96), "block_k must be a power of two"),
            ("bf16", kernels.TileConfig(8, 64, 64), "block_t must be a power of two ≥ 16")):
        state = forge_dsl.init_state("adamw", w, layout=layout)
        if message is None:
            kernels.fused_linear_step("adamw", x, dy, w, state, step=1, config=config)
            continue
        before = w.clone()
        with pytest.raises(ValueError, match=message):
            kernels.fused_linear_step("adamw", x, dy, w, state, step=1, config=config)
        assert torch.equal(w, before)  # refused before any launch


def test_default_tile_configs_on_the_h200():
    """docs/PERF.md, v7: the warp-specialized kernel on layers of 2^22 elements and more (bf16 activations,
    a Hopper GPU with Gluon; int8 state too since v9; a 5-buffer TMA ring since v13), its MMA warps updating
    a slice of each tile up to 512 tokens (v8); v4 and v5 otherwise: 128×128 tiles with a quarter-slice
    epilogue in 128 registers, except 64×64 tiles up to 512 tokens on layers of 2^24 elements and more,
    and up to 1024 on layers under 2^22; int8 state and float32 activations have their own tiles."""
    cuda = torch.device("cuda")
    ws = policy.fused_config(2048, 4096, 4096, cuda, hopper=True)
    assert (ws.block_n, ws.block_k, ws.num_stages, ws.epilogue_split, ws.mma_warps, ws.num_warps) == \
        (128, 128, 5, 4, 8, 8)
    assert ws.launch_maxnreg == 96  # 20 warps share an SM's 64 K registers
    assert ws.prefetch  # bf16 weights and two bf16 states: 6 bytes per element
    assert not policy.fused_config(2048, 4096, 4096, cuda, hopper=True, stored_bytes=10).prefetch  # two fp32 states
    assert policy.fused_config(512, 4096, 4096, cuda, hopper=True, stored_bytes=10).mma_slices == 0  # not measured
    assert policy.stored_bytes(True, (1, 0)) == 8  # layout codes: BF16, FP32
    assert policy.stored_bytes(False, (2,)) == 5  # INT8
    assert ws.mma_slices == 0  # the epilogue warps update every slice ...
    for T, n, k in ((8192, 14336, 4096), (2048, 128256, 4096), (513, 1024, 4096)):
        assert policy.fused_config(T, n, k, cuda, hopper=True) == ws
    for T, n, k in ((512, 4096, 4096), (512, 128256, 4096), (1, 1024, 4096)):  # ... the MMA warps one of 4 (v8)
        assert policy.fused_config(T, n, k, cuda, hopper=True) == dataclasses.replace(ws, mma_slices=1)
    assert not policy.fused_config(2048, 1024, 2048, cuda, hopper=True).warp_specialized  # 128 tiles: idle SMs
    assert not policy.fused_config(2048, 4096, 4096, cuda, hopper=True, warp_specialize=False).warp_specialized
    # int8 state (v9): the same kernel without the prefetch (it spills), the MMA warps' slice up to 512 tokens
    assert policy.fused_config(2048, 4096, 4096, cuda, quantized=True, hopper=True, stored_bytes=4) == \
        dataclasses.replace(ws, prefetch=False)
    assert policy.fused_config(512, 4096, 4096, cuda, quantized=True, hopper=True, stored_bytes=4) == \
        dataclasses.replace(ws, prefetch=False, mma_slices=1)
    assert not policy.fused_config(2048, 4096, 4096, cuda, activations=torch.float32, hopper=True).warp_specialized
    # without warp specialization (other GPUs, or no Gluon)
    split = policy.fused_config(2048, 4096, 4096, cuda, hopper=False)
    assert (split.block_n, split.block_k, split.epilogue_split, split.maxnreg, split.tma) == (128, 128, 4, 128, True)
    assert policy.fused_config(512, 1024, 4096, cuda, hopper=False) == split  # k/v: 256 tiles of 128×128
    assert policy.fused_config(8192, 14336, 4096, cuda, hopper=False) == split
    assert policy.fused_config(1024, 4096, 4096, cuda, hopper=False) == split  # v5: 128×128 faster from 1024 tokens
    for small in (policy.fused_config(512, 4096, 4096, cuda, hopper=False),
                  policy.fused_config(1024, 512, 512, cuda, hopper=False)):
        assert (small.block_n, small.block_k, small.epilogue_split, small.maxnreg) == (64, 64, 1, None)
    int8 = policy.fused_config(2048, 4096, 4096, cuda, quantized=True, hopper=False)  # v5: 128×64, two per SM
    assert (int8.block_n, int8.block_k, int8.epilogue_split, int8.maxnreg, int8.tma) == (128, 64, 1, 128, True)
    assert policy.fused_config(2048, 1024, 4096, cuda, quantized=True, hopper=False) == int8
    assert policy.fused_config(2048, 1024, 2048, cuda, quantized=True, hopper=True) == int8  # 128 tiles: idle SMs
    assert policy.fused_config(8192, 4096, 4096, cuda, quantized=True, hopper=False).block_k == 128
    assert policy.fused_config(2048, 4096, 4096, cuda, activations=torch.float32).block_k == 64
    for T in (1, 512, 2048, 8192):
        for n, k in ((4096, 4096), (1024, 4096), (128256, 4096), (64, 64)):
            for quantized in (False, True):
                for hopper in (False, True):
                    checks.check_config(policy.fused_config(T, n, k, cuda, quantized, hopper=hopper), quantized)


def test_warp_specialized_configs_are_refused_where_they_cannot_run():
    """A warp-specialized config (mma_warps > 0) is validated when made, and refused before any launch
    where its kernel cannot run, with what to use instead; `fused_config` falls back to the Triton
    kernel by itself (activations a TMA descriptor cannot read: no tokens, here)."""
    for bad, message in ((dict(mma_warps=2), "mma_warps must be 0"),
                         (dict(mma_warps=8, tma=True, k_halves=True, epilogue_split=2), "128×128 tiles, whole"),
                         (dict(mma_warps=8, tma=True, mma_registers=100), "mma_registers must be a multiple of 8"),
                         (dict(mma_warps=8, tma=True, num_stages=1), "a TMA ring of at least 2 buffers"),
                         (dict(mma_warps=8), "give it tma=True"),
                         (dict(mma_warps=8, tma=True, epilogue_split=4, mma_slices=4), "at least one of the tile"),
                         (dict(mma_registers=104), "apply to the warp-specialized kernel only"),
                         (dict(mma_slices=1), "apply to the warp-specialized kernel only")):
        with pytest.raises(ValueError, match=message):
            kernels.TileConfig(64, 128, 128, **bad)
    with pytest.raises(ValueError, match="128×128 tiles"):
        kernels.TileConfig(64, 64, 128, tma=True, mma_warps=8)
    assert kernels.TileConfig.parse("64,128,128,8,4,split=4,ws=8") == kernels.TileConfig(
        64, 128, 128, num_warps=8, num_stages=4, tma=True, epilogue_split=4, mma_warps=8, mma_registers=104)
    assert not kernels.TileConfig.parse("64,128,128,8,4,split=4,ws=8,prefetch=0").prefetch
    assert kernels.TileConfig.parse("64,128,128,8,4,split=4,ws=8,mmaslices=1").mma_slices == 1
    for bad in ("prefetch=7", "mmaslices=x", "slices=1"):
        with pytest.raises(ValueError, match=re.escape("prefetch=0|1 and mmaslices=SLICES")):
            kernels.TileConfig.parse(f"64,128,128,8,4,split=4,ws=8,{bad}")
    assert kernels.TileConfig(32, 128, 128, num_warps=4, tma=True, mma_warps=4).mma_registers == 200
    w, x, dy = make_problem(4, torch.bfloat16)
    if hopper_with_gluon():
        cases = [("bf16", x.float(), WS_CONFIG, "multiplies bfloat16 activations"),
                  ("bf16", x[:0], WS_CONFIG, "reads x and dy through TMA")]
    else:
        cases = [("bf16", x, WS_CONFIG, "runs only compiled on a Hopper GPU"),
                 ("int8", x, WS_CONFIG, "runs only compiled on a Hopper GPU")]
    for layout, xs, config, message in cases:
        state = forge_dsl.init_state("adamw", w, layout=layout)
        before = w.clone()
        with pytest.raises(ValueError, match=message):
            kernels.fused_linear_step("adamw", xs, dy[:xs.shape[0]].to(xs.dtype), w, state, step=1, config=config)
        assert torch.equal(w, before)  # refused before any launch
    if hopper_with_gluon():  # a layer that takes the warp-specialized default, with column-major activations
        big = torch.randn(4096, 4096, device=DEVICE).to(torch.bfloat16)
        xs = torch.randn(4096, 16, device=DEVICE).to(torch.bfloat16).t()  # [16, 4096], strides (1, 16)
        dys = torch.randn(16, 4096, device=DEVICE).to(torch.bfloat16)
        assert not checks.tma_compatible(xs)
        ref, state = big.clone(), forge_dsl.init_state("adamw", big, layout="bf16")
        kernels.step("adamw", ref, dys.float().T @ xs.float(), forge_dsl.init_state("adamw", big, layout="bf16"),
                     step=1, seed=3)
        kernels.fused_linear_step("adamw", xs, dys, big, state, step=1, seed=3)  # the Triton kernel's tiles
        assert (big.view(torch.int16) != ref.view(torch.int16)).float().mean().item() <= 1e-3


@pytest.mark.parametrize("name", ["adamw", "sgd_momentum", "lion"])
def test_zero_tokens_is_a_zero_gradient_step(name):
    spec = forge_dsl.load_spec(name)
    kw = hypers_for(name, weight_decay=0.1)
    w, _, _ = make_problem(4, torch.float32)
    x = torch.empty(0, K, device=DEVICE)
    dy = torch.empty(0, N, device=DEVICE)
    ref_w = w.double().cpu()
    ref_state = forge_dsl.init_state(spec, ref_w, **kw)
    state = forge_dsl.init_state(spec, w, layout="fp32", **kw)
    kernels.fused_linear_step(spec, x, dy, w, state, step=1, **kw)
    forge_dsl.reference_step(spec, ref_w, torch.zeros_like(ref_w), ref_state, step=1, **kw)
    assert rel_err(w, ref_w) <= FP32_REL_TOL
    assert not torch.equal(w.double().cpu(), make_problem(4, torch.float32)[0].double().cpu())  # decay acted


@pytest.mark.parametrize("config", [None, HALVES_CONFIG], ids=["default", "halves_tma"])
def test_strided_activations_and_leading_dims(config):
    """Leading dims are flattened; column-major activations (no TMA descriptor possible) take the pointer path."""
    w, x, dy = make_problem(5, torch.float32)
    ref_w = w.clone()
    st1 = forge_dsl.init_state("adamw", w, layout="fp32")
    st2 = forge_dsl.init_state("adamw", ref_w, layout="fp32")
    x3 = x.reshape(4, 10, K)
    xt = x.T.contiguous().T  # same values, column-major strides
    assert checks.tma_compatible(x) and not checks.tma_compatible(xt)
    assert not checks.tma_compatible(x[:1].expand(40, K))  # overlapping rows (stride 0)
    kernels.fused_linear_step("adamw", x3, dy.reshape(4, 10, N), w, st1, step=1, config=config)
    kernels.fused_linear_step("adamw", xt, dy, ref_w, st2, step=1, config=config)
    assert rel_err(w, ref_w) <= 1e-6


def test_launcher_errors_are_clear():
    w, x, dy = make_problem(6, torch.float32)
    st = forge_dsl.init_state("adamw", w, layout="fp32")
    with pytest.raises(ValueError, match="weight must be contiguous"):
        kernels.fused_linear_step("adamw", x, dy, torch.randn(K, N, device=DEVICE).T, st, step=1)
    with pytest.raises(ValueError, match="x has 3 features"):
        kernels.fused_linear_step("adamw", x[:, :3], dy, w, st, step=1)
    with pytest.raises(ValueError, match="same leading"):
        kernels.fused_linear_step("adamw", x[:5], dy, w, st, step=1)
    with pytest.raises(ValueError, match="step must be a positive integer"):
        kernels.fused_linear_step("adamw", x, dy, w, st, step=0)
    with pytest.raises(ValueError, match="Invalid betas\\[1\\] \\(beta2\\): 1.0"):
        kernels.fused_linear_step("adamw", x, dy, w, st, step=1, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="state has no 'max_exp_avg_sq'"):
        kernels.fused_linear_step("adamw", x, dy, w, st, step=1, amsgrad=True)
    with pytest.raises(ValueError, match="rounding must be one of"):
        kernels.step("adamw", w, w.clone(), st, step=1, rounding="up")
    with pytest.raises(ValueError, match="float32 and bfloat16"):
        kernels.step("adamw", w.half(), w.half(), forge_dsl.init_state("adamw", w.half(), layout="fp32"), step=1)
    with pytest.raises(TypeError, match="did you mean 'lr'"):
        kernels.step("adamw", w, w.clone(), st, step=1, lrr=0.1)
    with pytest.raises(ValueError, match="slab_bytes must be a positive integer"):
        kernels.slab_linear_step("adamw", x, dy, w, st, step=1, slab_bytes=0)
    with pytest.raises(ValueError, match="x has 3 features"):
        kernels.slab_linear_step("adamw", x[:, :3], dy, w, st, step=1)


def test_user_spec_compiles_on_first_use(tmp_path, monkeypatch):
    """A new optimizer needs no compiler change: Adamax, checked against torch.optim.Adamax."""
    monkeypatch.setenv("FORGE_DSL_CACHE", str(tmp_path / "cache"))
    from forge_dsl.compiler import loader as compiled

    compiled._compiled.cache_clear()  # another test may have compiled the same spec into its own cache
    path = tmp_path / "adamax.fopt"
    path.write_text(ADAMAX)
    w, x, dy = make_problem(8, torch.float32)
    theirs = w.detach().cpu().double().clone().requires_grad_(True)
    opt = torch.optim.Adamax([theirs], lr=1e-2, weight_decay=0.01)
    state = forge_dsl.init_state(str(path), w, layout="fp32")
    for step in range(1, 4):
        kernels.fused_linear_step(str(path), x, dy, w, state, step=step, lr=1e-2, weight_decay=0.01)
        theirs.grad = dy.double().cpu().T @ x.double().cpu()
        opt.step()
    assert rel_err(w, theirs.detach()) <= FP32_REL_TOL
    assert any((tmp_path / "cache").glob("adamax_*.py"))


_SCALED_SGD = """optimizer scaled "SGD with its step scaled by a constant"
hyper lr = 0.01 in [0, inf)
update {{
    param = param - lr * {scale} * grad
}}
"""


def _scaled_sgd_step(folder, scale: float, w, x, dy) -> torch.Tensor:
    """One fused step of `_SCALED_SGD` (written into `folder`) on a copy of w."""
    path = folder / "scaled.fopt"
    folder.mkdir()
    path.write_text(_SCALED_SGD.format(scale=scale))
    w = w.clone()
    kernels.fused_linear_step(str(path), x, dy, w, {}, step=1, lr=1e-2)
    return w


def test_two_specs_share_the_library_kernels_each_with_its_own_update(tmp_path, monkeypatch):
    """The library kernels (`tile_kernels`) are shared by every spec, the update passed in: two specs of the same
    name whose updates differ only in a constant, in one process, each run their own (Triton keys a compiled
    kernel on the update's source, not its name)."""
    monkeypatch.setenv("FORGE_DSL_CACHE", str(tmp_path / "cache"))
    w, x, dy = make_problem(8, torch.float32)
    dw = dy.double().T @ x.double()
    for scale, folder in ((1.0, "one"), (3.0, "three"), (1.0, "one_again")):
        got = _scaled_sgd_step(tmp_path / folder, scale, w, x, dy)
        assert rel_err(got, w.double() - 1e-2 * scale * dw) <= FP32_REL_TOL, scale


_DISK_CACHE_RUN = """
import sys, torch
from pathlib import Path
sys.path[:0] = [sys.argv[3], str(Path(sys.argv[3]).parent / "helpers")]
from test_kernels import _scaled_sgd_step, make_problem, rel_err
w, x, dy = make_problem(8, torch.float32)
got = _scaled_sgd_step(Path(sys.argv[1]), float(sys.argv[2]), w, x, dy)
print(rel_err(got, w.double() - 1e-2 * float(sys.argv[2]) * (dy.double().T @ x.double())))
"""


@pytest.mark.gpu
def test_triton_disk_cache_tells_updates_apart(tmp_path):
    """The same across processes through Triton's disk cache: a process that compiled one spec's kernels leaves
    them in the cache, and another spec of the same name (another constant) does not get them."""
    import os
    import subprocess
    import sys

    if DEVICE.type != "cuda":
        pytest.skip("the interpreter compiles nothing")
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton"), "FORGE_DSL_CACHE": str(tmp_path / "cache")}
    for scale, folder in ((1.0, "one"), (3.0, "three")):
        out = subprocess.run([sys.executable, "-c", _DISK_CACHE_RUN, str(tmp_path / folder), str(scale),
                              os.path.dirname(__file__)], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert float(out.stdout.strip().splitlines()[-1]) <= FP32_REL_TOL, (scale, out.stdout)




# ----------------------------------------------------------------------------
# GPU only: a large shape against cuBLAS dW + the reference step
# ----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16], ids=["w_fp32", "w_bf16"])
def test_large_shape_against_cublas(w_dtype):
    n, k, t = 4096, 4096, 2048
    spec = forge_dsl.load_spec("adamw")
    w, x, dy = make_problem(9, w_dtype, n=n, k=k, t=t)
    state = forge_dsl.init_state(spec, w, layout="fp32")
    ref_w = w.float().clone()
    ref_state = forge_dsl.init_state(spec, ref_w)
    dw = (dy.float().T @ x.float())  # cuBLAS
    forge_dsl.reference_step(spec, ref_w, dw, ref_state, step=1, lr=1e-3)
    kernels.fused_linear_step(spec, x, dy, w, state, step=1, lr=1e-3)
    if w_dtype == torch.float32:
        assert rel_err(w, ref_w) <= FP32_REL_TOL
    else:
        # Stochastic rounding lands each weight on a bf16 neighbour of the exact value.  The
        # exception: elements whose dW is below the GEMMs' rounding error (a few per 16M here)
        # may take Adam's first step (±lr) with the other sign, in the kernel or in cuBLAS.
        outside = ((w.float() - ref_w).abs() > bf16_ulp(ref_w) * 1.001 + 1e-4 * ref_w.abs()).sum().item()
        assert outside <= 1e-5 * w.numel(), outside
        assert rel_err(w, ref_w) <= 2.0**-8
    assert rel_err(state["exp_avg"], ref_state["exp_avg"]) <= 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("t", [512, 2048, 8192])
@pytest.mark.parametrize("n", [4096, 1024])
def test_default_configs_on_llama_sized_layers(n, t, layout):
    """Each H200 default config at Llama-sized layers (q/o 4096², k/v 1024×4096): the warp-specialized
    kernel as shipped (8 MMA warps, 5 ring buffers; 1024 or 256 tiles over 132 persistent programs, so
    every barrier of the ring and of the dW hand-over wraps its phase many times), with bf16 state and with
    int8 state (no prefetch; the MMA warps' slice at 512 tokens): the fused step against the element-wise step on
    cuBLAS's fp32 dW, from the same bf16 weights and state. Both quantize and round with the same code,
    so the two differ only where the two dW sums (different fp32 orders) straddle a rounding boundary."""
    k = 4096
    spec = forge_dsl.load_spec("adamw")
    w, x, dy = make_problem(10 + t + n, torch.bfloat16, n=n, k=k, t=t)
    state = forge_dsl.init_state(spec, w, layout=layout)
    kernels.step(spec, w, torch.randn(n, k, device=DEVICE) * 1e-2, state, step=1, lr=1e-3)  # a non-zero state
    w2, state2 = w.clone(), {name: v.clone() for name, v in state.items()}
    kernels.fused_linear_step(spec, x, dy, w, state, step=2, seed=5, lr=1e-3)
    kernels.step(spec, w2, dy.float().T @ x.float(), state2, step=2, seed=5, lr=1e-3)
    differ = (w.view(torch.int16) != w2.view(torch.int16)).float().mean().item()
    assert differ <= 1e-3, differ  # rounding-boundary cases only
    assert rel_err(w, w2) <= 2.0**-9
    got, ref = as_float64_state(state, spec), as_float64_state(state2, spec)
    for name in ("exp_avg", "exp_avg_sq"):
        assert rel_err(got[name], ref[name]) <= {"bf16": 2.0**-8, "int8": 1e-2, "int4": 5e-2}[layout], name


def test_slab_rows_are_whole_aligned_rows_within_the_budget():
    mib16 = 16 * 2**20
    assert policy.slab_rows(4096, 14336, 4, mib16) == 256  # 292 rows fit: rounded down to cuBLAS-friendly 256
    assert policy.slab_rows(128256, 4096, 4, mib16) == 1024
    assert policy.slab_rows(300, 4096, 4, mib16) == 300  # the whole weight fits: one slab
    assert policy.slab_rows(72, 136, 4, 20 * 136 * 4) == 20  # under 128 rows: kept as they are
    assert policy.slab_rows(72, 136, 4, 1) == 1  # at least one row


def test_slab_bytes_default_by_state_layout(monkeypatch):
    """Without `slab_bytes`, the slab path takes 16 MiB slabs, and 32 MiB ones with int8 state."""
    budgets = []
    real_slab_rows = policy.slab_rows
    monkeypatch.setattr(slabs, "slab_rows", lambda N, K, size, budget: budgets.append(budget) or
                        real_slab_rows(N, K, size, budget))
    w, x, dy = make_problem(14, torch.float32)
    for layout in ("bf16", "int8"):
        kernels.slab_linear_step("adamw", x, dy, w.clone(), forge_dsl.init_state("adamw", w, layout=layout), step=1)
    kernels.slab_linear_step("adamw", x, dy, w.clone(), forge_dsl.init_state("adamw", w, layout="int8"), step=1,
                             slab_bytes=4096)
    assert budgets == [16 * 2**20, 32 * 2**20, 4096]


def test_auto_linear_path():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    big = 4096 * 4096
    assert policy.auto_linear_path(8192, big, torch.bfloat16, cuda, hopper=False) == "slab"
    assert policy.auto_linear_path(8192, big, torch.bfloat16, cuda, hopper=True) == "fused"  # v7: warp-specialized
    # ... which reads through TMA: activations it cannot read keep the v3 rule
    assert policy.auto_linear_path(8192, big, torch.bfloat16, cuda, hopper=True, tma=False) == "slab"
    assert policy.auto_linear_path(4096, big, torch.bfloat16, cuda, hopper=False) == "fused"
    assert policy.auto_linear_path(8192, 1024 * 4096, torch.bfloat16, cuda, hopper=False) == "fused"  # k/v
    assert policy.auto_linear_path(8192, big, torch.float32, cuda) == "fused"  # fp32: the fused kernel's exact product
    assert policy.auto_linear_path(8192, big, torch.bfloat16, cpu) == "fused"
    # int8 state: the slab path from 2048 tokens, on every layer (v5)
    assert policy.auto_linear_path(2048, 1024 * 4096, torch.bfloat16, cuda, quantized=True, hopper=False) == "slab"
    assert policy.auto_linear_path(2047, big, torch.bfloat16, cuda, quantized=True, hopper=False) == "fused"
    # int8 state where the warp-specialized kernel runs (v9): the slab path up to 512 tokens, that kernel above,
    # unless its launches are reused (v14): then that kernel at every token count
    for tokens, path in ((1, "slab"), (512, "slab"), (513, "fused"), (2048, "fused"), (8192, "fused")):
        assert policy.auto_linear_path(tokens, 1024 * 4096, torch.bfloat16, cuda, quantized=True, hopper=True,
                                       reused=False) == path
        assert policy.auto_linear_path(tokens, 1024 * 4096, torch.bfloat16, cuda, quantized=True, hopper=True,
                                       reused=True) == "fused"
    assert policy.auto_linear_path(8192, big, torch.bfloat16, cuda, quantized=True, hopper=True, tma=False) == "slab"
    assert policy.auto_linear_path(8192, 1024 * 2048, torch.bfloat16, cuda, quantized=True, hopper=True) == "slab"
    assert policy.auto_linear_path(1024, 1024 * 2048, torch.bfloat16, cuda, quantized=True, hopper=True) == "fused"
    assert policy.auto_linear_path(8192, big, torch.float32, cuda, quantized=True) == "fused"
    w, x, dy = make_problem(12, torch.float32)
    with pytest.raises(ValueError, match="path must be one of auto, fused, slab, got 'gemm'"):
        kernels.linear_step("adamw", x, dy, w, forge_dsl.init_state("adamw", w), step=1, path="gemm")


def test_resolved_hypers_are_remembered_only_where_they_cannot_change():
    """`steps.resolved_hypers` (the per-call keyword resolution, remembered: docs/PERF.md v9c) gives what
    `resolve_hypers` gives, tells apart keywords that resolve differently, and never remembers a tensor or
    a failure."""
    spec = forge_dsl.load_spec("adamw")
    kw = {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.1}
    got = steps.resolved_hypers(spec, dict(kw))
    assert got == resolve_hypers(spec, kw) and steps.resolved_hypers(spec, dict(kw)) is got
    zero, minus_zero = (steps.resolved_hypers(spec, {**kw, "weight_decay": z}) for z in (0.0, -0.0))
    assert math.copysign(1.0, zero.hypers["weight_decay"]) == 1.0
    assert math.copysign(1.0, minus_zero.hypers["weight_decay"]) == -1.0
    lr = torch.tensor(1e-3)
    assert steps.resolved_hypers(spec, {**kw, "lr": lr}).hypers["lr"] == pytest.approx(1e-3)
    lr.fill_(2e-3)  # a scheduler may change a tensor lr in place
    assert steps.resolved_hypers(spec, {**kw, "lr": lr}).hypers["lr"] == pytest.approx(2e-3)
    for _ in range(2):
        with pytest.raises(ValueError, match="Invalid lr"):
            steps.resolved_hypers(spec, {**kw, "lr": -1.0})
    nadam = forge_dsl.load_spec("nadam")
    assert steps.resolved_hypers(nadam, {"lr": 1e-3}).combo != ()  # another spec: its own flags
    assert steps.resolved_hypers(nadam, {"lr": 1e-3}) == resolve_hypers(nadam, {"lr": 1e-3})


def test_tma_readable_without_reshaping():
    """linear_step's check of what the fused kernel will read equals `tma_compatible` of the 2-D reshape
    the kernel makes (a view, or for strides no view can merge, a contiguous copy), without making it."""
    base = torch.randn(4, 10, 136).to(torch.bfloat16)
    cases = [base, base[:, :5, :], base[:, ::2, :], base.transpose(0, 1), base[..., :100], base[..., :4],
             base[:0], torch.randn(3, 9).to(torch.bfloat16)]
    for t in cases:
        assert checks.tma_readable(t) == (t.numel() > 0 and checks.tma_compatible(t.reshape(-1, t.shape[-1]))), \
            (tuple(t.shape), t.stride())


def test_linear_step_routes_each_option_to_its_path(monkeypatch):
    calls = []
    monkeypatch.setattr(steps.ParamUpdate, "_fused", lambda self, x2, dy2, w, states, key, tf32, config:
                        calls.append(("fused", config, self.exports)))
    monkeypatch.setattr(steps, "slab_linear_step", lambda *a, **kw: calls.append(("slab", kw)))
    w, x, dy = make_problem(13, torch.bfloat16)
    config = kernels.TileConfig(64, 64, 64, num_warps=4, num_stages=1)
    state = forge_dsl.init_state("adamw", w, layout="bf16")
    for path in ("fused", "slab", "auto"):
        kernels.linear_step("adamw", x, dy, w, state, path=path, step=1, config=config, slab_bytes=2**20, lr=0.1)
    (fused, f_config, f_exports), (slab, s_kw), (auto, _, a_exports) = calls
    assert (fused, slab, auto) == ("fused", "slab", "fused")  # auto: CPU
    reference = steps.ParamUpdate("adamw", w, state, step=1, lr=0.1).exports  # the keywords reached the variant
    assert f_config is config and f_exports == a_exports == reference
    assert reference != steps.ParamUpdate("adamw", w, state, step=1, lr=0.2).exports
    assert s_kw["slab_bytes"] == 2**20 and "config" not in s_kw and "tf32" not in s_kw and s_kw["step"] == 1
    assert s_kw["lr"] == 0.1
    # "auto" asks with the layer's token count, size, whether its state is quantized and whether TMA can read
    # the activations (not column-major ones)
    asked = []
    monkeypatch.setattr(steps, "auto_linear_path", lambda *a, **kw: asked.append((*a, kw)) or "fused")
    for layout in ("bf16", "int8"):
        state = forge_dsl.init_state("adamw", w, layout=layout)
        kernels.linear_step("adamw", x, dy, w, state, step=1, lr=0.1)
    kernels.linear_step("adamw", x.t().contiguous().t(), dy, w, state, step=1, lr=0.1)
    assert asked == [(T, N * K, torch.bfloat16, w.device, False, {"tma": True}),
                     (T, N * K, torch.bfloat16, w.device, True, {"tma": True}),
                     (T, N * K, torch.bfloat16, w.device, True, {"tma": False})]


@pytest.mark.parametrize("layout", ["fp32", "int8"])
def test_param_update_row_blocks_equal_the_whole_layer(layout):
    """`ParamUpdate` binds one step once and launches it on blocks of rows (what a fused LM head's vocabulary
    blocks use): with fp32 weights (no rounding bits), blocks in any order, of ragged sizes, give the bits of
    one whole-layer call, fused from dy's column blocks and element-wise from dW's row blocks alike; NAdam's
    scalar state moves once, at commit."""
    n = 200  # blocks of 64, 72 and 64 rows: one ragged against the interpreter's 64-row tiles
    w, x, dy = make_problem(21, torch.float32, n=n)
    # activations on a grid of 1/64 in [-2, 2]: every product and sum of dW is exact in fp32, so its bits do not
    # depend on where a row sits in a tile (the interpreter's matmul may round a tile's edge rows apart)
    x, dy = (torch.round(t.clamp(-2, 2) * 64) / 64 for t in (x, dy))
    blocks = [(136, 200), (0, 64), (64, 136)]
    for spec in ("adamw", "nadam"):
        whole_w, whole_state = w.clone(), forge_dsl.init_state(spec, w, layout=layout)
        for step in (1, 2):
            kernels.fused_linear_step(spec, x, dy, whole_w, whole_state, step=step, lr=0.01)
        for use in ("fused", "from_grad"):
            w_blocks, state = w.clone(), forge_dsl.init_state(spec, w, layout=layout)
            for step in (1, 2):
                update = steps.ParamUpdate(spec, w_blocks, state, step=step, lr=0.01)
                scalars = {s.name: float(state[s.name]) for s in update.spec.scalars}
                for r0, r1 in blocks:
                    if use == "fused":
                        update.fused(x, dy[:, r0:r1], rows=r0)
                    else:
                        update.from_grad(dy[:, r0:r1].t() @ x, rows=r0)
                    assert {name: float(state[name]) for name in scalars} == scalars  # not before commit
                update.commit()
            if use == "fused":
                assert torch.equal(w_blocks, whole_w), (spec, layout)
                for name, t in whole_state.items():
                    assert torch.equal(state[name], t), (spec, layout, name)
            else:  # dW from a torch matmul: its own summation order
                assert rel_err(w_blocks, whole_w) < 1e-5, (spec, layout)
            if spec == "nadam":
                assert float(state["mu_product"]) == float(whole_state["mu_product"]) != 1.0


def test_param_update_refuses_rows_outside_the_parameter():
    w, x, dy = make_problem(22, torch.bfloat16)
    state = forge_dsl.init_state("adamw", w)
    before = w.clone()
    update = steps.ParamUpdate("adamw", w, state, step=1)
    for rows in (-1, N - 10, 1.5, True):
        with pytest.raises(ValueError, match="rows must be an int with"):
            update.fused(x, dy[:, :16], rows=rows)
    with pytest.raises(ValueError, match=r"grad has shape \(3, 5\) but the rows it updates have \(3, 136\)"):
        update.from_grad(torch.zeros(3, 5), rows=0)
    with pytest.raises(ValueError, match="row blocks need a 2-D parameter"):
        steps.ParamUpdate("adamw", w[0], forge_dsl.init_state("adamw", w[0]), step=1).from_grad(w[0], rows=0)
    assert torch.equal(w, before)
