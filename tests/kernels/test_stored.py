"""`stored(x)`: a value rounded as this step's store of the weight rounds it (Kahan-compensated bf16 weights).

A bf16 weight loses every update below half its ulp under nearest rounding. A Kahan-compensated spec keeps
the part the store rounds away in an fp32 state and adds it to the next update; it needs the rounding the
store will make, which `stored(x)` gives (docs/LANGUAGE.md §8). Checked here:

* a Kahan SGD on bf16 weights with nearest rounding writes the bits of a torch bf16 Kahan loop written
  independently (fp32 compensation buffer), and so does `reference_step(..., weight_dtype=torch.bfloat16)`;
* a Kahan AdamW follows the exact (float64) trajectory to half a bf16 ulp, where plain AdamW with nearest
  rounding never moves the weights; against the torch loop it agrees in every bit but where the two fp32
  update formulas round to different sides of a bf16 midpoint (bounded, below);
* `stored(param)` after the last assignment is the written weight, bit for bit, with stochastic and nearest
  rounding, on every kernel (step, fused under its configs, slab, foreach, row blocks) and state layout;
* the checker's rules for `stored`.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import forge_dsl
from forge_dsl import kernels
from forge_dsl.compiler.lowering import lower
from forge_dsl.kernels.foreach import foreach_step
from forge_dsl.kernels.steps import ParamUpdate
from forge_dsl.spec.checker import check_spec
from forge_dsl.spec.errors import SpecError
from forge_dsl.spec.parser import parse_spec
from forge_dsl.testing import HALVES_CONFIG, SPLIT_CONFIGS, bf16_ulp, default_device

DEVICE = default_device()

KAHAN_SGD = """
# SGD on Kahan-compensated weights: comp keeps what the weight's store rounds away.
optimizer kahan_sgd
hyper lr = 1e-3 in [0, inf)
state comp = 0 exact
update {
    y = comp - lr * grad
    new = param + y
    comp = y - (stored(new) - param)
    param = new
}
"""

# AdamW on Kahan-compensated weights (also compiled for sm_90 by test_sm90.py, the warp-specialized kernel's too).
KAHAN_ADAMW_PATH = Path(__file__).with_name("kahan_adamw.fopt")
KAHAN_ADAMW = KAHAN_ADAMW_PATH.read_text()

# Writes what the store wrote into an exact state: `written` must be the new weight, bit for bit.
PROBE = """
optimizer stored_probe
hyper lr = 1e-3 in [0, inf)
state m = 0
state written = 0 exact
update {
    m = 0.9 * m + grad
    param = param - lr * m
    written = stored(param)
}
"""


@pytest.fixture(scope="module")
def spec_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("specs")


_DIR = []


@pytest.fixture(autouse=True)
def _specs_in(spec_dir):
    _DIR[:] = [spec_dir]


def spec_of(text: str, name: str):
    """The spec `text`, loaded from a file `name`.fopt in a temporary folder (as a user's spec is)."""
    path = _DIR[0] / f"{name}.fopt"
    path.write_text(text)
    return forge_dsl.load_spec(str(path))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32).cpu()


def fp32_bits_of_weight(w: torch.Tensor) -> torch.Tensor:
    return w.float().contiguous().view(torch.int32).cpu()


# ---------------------------------------------------------------------------
# Kahan SGD: the bits of an independent torch loop
# ---------------------------------------------------------------------------


def torch_kahan_sgd(p: torch.Tensor, grads, lr: float):
    """Kahan-compensated SGD on a bf16 weight in plain torch: fp32 arithmetic, an fp32 compensation buffer, the
    weight written by torch's bf16 conversion (round to nearest even)."""
    p = p.clone()
    c = torch.zeros(p.shape, dtype=torch.float32)
    lr32 = torch.tensor(lr, dtype=torch.float32)
    for g in grads:
        pf = p.float()
        y = c - lr32 * g
        t = pf + y
        p = t.to(torch.bfloat16)
        c = y - (p.float() - pf)
    return p, c


def test_kahan_sgd_writes_the_bits_of_a_torch_kahan_loop():
    spec = spec_of(KAHAN_SGD, "kahan_sgd")
    gen = torch.Generator().manual_seed(11)
    p0 = (1 + torch.rand(48, 136, generator=gen)).to(torch.bfloat16)  # |w| in [1, 2]: ulp 2**-7
    grads = [torch.randn(p0.shape, generator=gen) + 0.5 for _ in range(30)]
    lr = 2.0**-12  # every update below half an ulp; lr * g exact, so a GPU's FMA changes no bit either
    want_p, want_c = torch_kahan_sgd(p0, grads, lr)

    w = p0.clone().to(DEVICE)
    state = forge_dsl.init_state(spec, w, layout="fp32")
    ref_w = p0.float()  # reference_step in fp32, writing a bf16 weight
    ref_state = forge_dsl.init_state(spec, ref_w)
    for step, g in enumerate(grads, 1):
        kernels.step(spec, w, g.to(DEVICE), state, step=step, rounding="nearest", lr=lr)
        forge_dsl.reference_step(spec, ref_w, g, ref_state, step=step, weight_dtype=torch.bfloat16, lr=lr)
    assert torch.equal(bits(w), bits(want_p))
    assert torch.equal(bits(state["comp"]), bits(want_c))
    assert torch.equal(bits(ref_w), fp32_bits_of_weight(want_p))
    assert torch.equal(bits(ref_state["comp"]), bits(want_c))
    assert (want_c != 0).float().mean() > 0.9  # the compensation is at work
    assert not torch.equal(bits(want_p), bits(p0))


# ---------------------------------------------------------------------------
# Kahan AdamW: the exact trajectory to half an ulp, where plain nearest rounding loses it
# ---------------------------------------------------------------------------

ADAMW_KW = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)


def torch_kahan_adamw(p: torch.Tensor, grads, lr, betas, eps, weight_decay, dtype=torch.float32, kahan=True):
    """AdamW as torch.optim.AdamW's single-tensor loop computes it, on a weight kept in bf16 with a Kahan
    compensation buffer (dtype float32), or with the weight itself in `dtype` (float64: the exact trajectory)."""
    b1, b2 = betas
    p = p.to(dtype) if not kahan else p.clone()
    work = torch.float32 if kahan else dtype
    m = torch.zeros(p.shape, dtype=work)
    v = torch.zeros(p.shape, dtype=work)
    c = torch.zeros(p.shape, dtype=work)
    for t, g in enumerate(grads, 1):
        g = g.to(work)
        pf = p.to(work)
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = (v.sqrt() / math.sqrt(1 - b2**t)).add_(eps)
        y = c - lr * weight_decay * pf - (lr / (1 - b1**t)) * m / denom
        new = pf + y
        if kahan:
            p = new.to(torch.bfloat16)
            c = y - (p.to(work) - pf)
        else:
            p = new
    return p, c


def adamw_problem(steps=150):
    gen = torch.Generator().manual_seed(5)
    p0 = (0.5 + 0.5 * torch.rand(40, 136, generator=gen)).to(torch.bfloat16)  # |w| in [0.5, 1]: ulp 2**-8
    # gradients with a steady sign per element, so the weights travel many ulps in `steps` steps of ~lr
    drift = torch.randn(p0.shape, generator=gen).sign()
    grads = [drift + 0.5 * torch.randn(p0.shape, generator=gen) for _ in range(steps)]
    return p0, grads


def rel_error(w: torch.Tensor, exact: torch.Tensor, p0: torch.Tensor) -> float:
    """‖w − exact‖ / ‖exact − w0‖: the error as a fraction of how far the weights travelled."""
    w, exact, p0 = (t.double().cpu() for t in (w, exact, p0))
    return ((w - exact).norm() / (exact - p0).norm()).item()


def test_kahan_adamw_follows_the_exact_trajectory_where_nearest_rounding_loses_it():
    spec = spec_of(KAHAN_ADAMW, "kahan_adamw")
    p0, grads = adamw_problem()
    exact, _ = torch_kahan_adamw(p0, grads, dtype=torch.float64, kahan=False, **ADAMW_KW)
    torch_p, torch_c = torch_kahan_adamw(p0, grads, **ADAMW_KW)

    w = p0.clone().to(DEVICE)
    state = forge_dsl.init_state(spec, w, layout="fp32")
    plain = p0.clone().to(DEVICE)
    plain_state = forge_dsl.init_state("adamw", plain, layout="fp32")
    for step, g in enumerate(grads, 1):
        kernels.step(spec, w, g.to(DEVICE), state, step=step, rounding="nearest", **ADAMW_KW)
        kernels.step("adamw", plain, g.to(DEVICE), plain_state, step=step, rounding="nearest", **ADAMW_KW)

    # Plain AdamW: each update (~lr = 1e-3) is below half an ulp (2**-9), so nearest rounding loses all of them.
    assert rel_error(plain, exact, p0) > 0.99
    # Kahan: weight + compensation is the fp32 sum of the updates, and the weight its nearest bf16, so each
    # weight is within half an ulp of the exact trajectory, plus the fp32 drift of 150 summed updates.
    ulp = bf16_ulp(exact.double())
    err = (w.double().cpu() - exact).abs()
    assert (err <= 0.5 * ulp + 1e-5).all(), (err - 0.5 * ulp).max()
    # 0.0096 here (the torch loop's too); the torch bf16 Kahan loop: 0.0076; plain nearest: 0.995
    assert rel_error(w, exact, p0) < 0.012
    # Against the independent torch loop: the two fp32 update formulas differ by a few fp32 ulps of the update
    # (the spec and torch order their fp32 operations differently), so where the sum lands within that of a bf16
    # midpoint the two weights round apart by one ulp, and their compensations then differ by that ulp. What
    # both track, weight + compensation, agrees to that fp32 slack; the weights agree in almost every bit.
    got_p, got_c = w.cpu(), state["comp"].cpu()
    total_gap = ((got_p.double() + got_c.double()) - (torch_p.double() + torch_c.double())).abs()
    assert total_gap.max() <= 1e-5, total_gap.max()
    apart = (got_p.double() - torch_p.double()).abs()
    assert (apart <= bf16_ulp(torch_p.double()) * 1.001).all()
    assert (bits(got_p) != bits(torch_p)).float().mean() <= 1e-3


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_reference_step_rounds_a_bf16_weight_as_the_kernel_does(rounding):
    """reference_step with weight_dtype=bfloat16 writes bf16 values and keeps the Kahan compensation as the
    kernel does: in float64, without re-synchronising, within an ulp of the kernel's weights, weight +
    compensation within fp32 slack of the kernel's. (Bit for bit from float32 where the ops are correctly
    rounded in torch too: test_kahan_sgd_writes_the_bits_of_a_torch_kahan_loop. torch's CPU float32 sqrt is
    not: it is an ulp off the correctly rounded root for about a fifth of inputs, the interpreter's is not.)

    The reference rounds to nearest; it does not reproduce the kernels' stochastic bits. Against a stochastic
    kernel the bound is the same: both weights are a bf16 neighbour of the same fp32 sum (an ulp apart at
    most), and weight + compensation, which does not depend on the rounding, agrees to the fp32 slack."""
    spec = spec_of(KAHAN_ADAMW, "kahan_adamw")
    p0, grads = adamw_problem(steps=20)
    w = p0.clone().to(DEVICE)
    state = forge_dsl.init_state(spec, w, layout="fp32")
    ref = p0.double()
    ref_state = forge_dsl.init_state(spec, ref)
    for step, g in enumerate(grads, 1):
        kernels.step(spec, w, g.to(DEVICE), state, step=step, seed=3, rounding=rounding, **ADAMW_KW)
        forge_dsl.reference_step(spec, ref, g.double(), ref_state, step=step, weight_dtype=torch.bfloat16,
                                 **ADAMW_KW)
        assert torch.equal(ref.to(torch.bfloat16).double(), ref), step  # values a bf16 holds
        assert ((ref - w.double().cpu()).abs() <= bf16_ulp(ref) * 1.001).all(), step
        total = (ref + ref_state["comp"]) - (w.double().cpu() + state["comp"].double().cpu())
        assert total.abs().max() <= 1e-6, (step, total.abs().max())
    same = (bits(ref.to(torch.bfloat16)) == bits(w)).float().mean()
    assert same >= 0.999 if rounding == "nearest" else same < 0.99  # stochastic: other bits, the same sums
    assert (ref_state["comp"] != 0).float().mean() > 0.9


def test_reference_step_without_weight_dtype_keeps_the_parameter_dtype():
    """stored(x) is x in the parameter's own dtype by default: a float64 weight, whose compensation holds only
    float64 rounding errors; a dtype that is not a float is refused."""
    spec = spec_of(KAHAN_SGD, "kahan_sgd")
    p = torch.randn(8, 64, dtype=torch.float64)
    state = forge_dsl.init_state(spec, p)
    g = torch.randn(8, 64, dtype=torch.float64)
    before = p.clone()
    forge_dsl.reference_step(spec, p, g, state, step=1, lr=0.1)
    y = 0 - 0.1 * g
    assert torch.equal(p, before + y)
    assert torch.equal(state["comp"], y - ((before + y) - before))
    assert (state["comp"].abs() <= p.abs() * 2.0**-52).all()  # half an ulp of the new weight
    with pytest.raises(ValueError, match="weight_dtype must be a float torch.dtype"):
        forge_dsl.reference_step(spec, p, g, state, step=2, weight_dtype=torch.int8, lr=0.1)


# ---------------------------------------------------------------------------
# stored(param) is the written weight, bit for bit, on every kernel
# ---------------------------------------------------------------------------


def _probe_state(spec, w, layout):
    return forge_dsl.init_state(spec, w, layout={"m": layout} if layout != "fp32" else "fp32")


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("cols", [136, 135])  # even: one hash per two neighbours; odd: one per element
@pytest.mark.parametrize("layout", ["fp32", "int8", "int4"])
def test_stored_param_is_the_written_weight_step(rounding, cols, layout):
    spec = spec_of(PROBE, "stored_probe")
    gen = torch.Generator().manual_seed(cols)
    w = torch.randn(24, cols, generator=gen).to(torch.bfloat16).to(DEVICE)
    state = _probe_state(spec, w, layout)
    for step in (1, 2):
        g = torch.randn(w.shape, generator=gen).to(DEVICE)
        kernels.step(spec, w, g, state, step=step, seed=9, rounding=rounding, lr=3e-3)
        assert torch.equal(bits(state["written"]), fp32_bits_of_weight(w)), step


@pytest.mark.parametrize("config", ["default", "halves", "split"])
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_stored_param_is_the_written_weight_fused(config, rounding):
    spec = spec_of(PROBE, "stored_probe")
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(72, 136, generator=gen).to(torch.bfloat16).to(DEVICE)
    layout = "int8" if config == "split" else "fp32"
    state = _probe_state(spec, w, layout)
    cfg = {"default": None, "halves": HALVES_CONFIG, "split": SPLIT_CONFIGS[True]}[config]
    for step in (1, 2):
        x = torch.randn(40, 136, generator=gen).to(torch.bfloat16).to(DEVICE)
        dy = (0.1 * torch.randn(40, 72, generator=gen)).to(torch.bfloat16).to(DEVICE)
        kernels.fused_linear_step(spec, x, dy, w, state, step=step, seed=4, rounding=rounding, config=cfg, lr=1e-2)
        assert torch.equal(bits(state["written"]), fp32_bits_of_weight(w)), step


def test_stored_param_is_the_written_weight_slab_rows_and_foreach():
    spec = spec_of(PROBE, "stored_probe")
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(72, 136, generator=gen).to(torch.bfloat16).to(DEVICE)
    state = _probe_state(spec, w, "int4")
    x = torch.randn(40, 136, generator=gen).to(torch.bfloat16).to(DEVICE)
    dy = (0.1 * torch.randn(40, 72, generator=gen)).to(torch.bfloat16).to(DEVICE)
    kernels.slab_linear_step(spec, x, dy, w, state, step=1, seed=2, slab_bytes=20 * 136 * 2, lr=1e-2)
    assert torch.equal(bits(state["written"]), fp32_bits_of_weight(w))
    # a parameter stepped in blocks of rows (the fused LM head's, the embedding's)
    update = ParamUpdate(spec, w, state, step=2, seed=2, lr=1e-2)
    for r0 in (40, 0):
        update.from_grad(torch.randn(w[r0:r0 + 32].shape, generator=gen).to(DEVICE), rows=r0)
    update.commit()
    assert torch.equal(bits(state["written"]), fp32_bits_of_weight(w))
    # several small parameters in one launch
    params = [torch.randn(shape, generator=gen).to(torch.bfloat16).to(DEVICE) for shape in ((7, 5), (33,), (3, 64))]
    states = [forge_dsl.init_state(spec, p, layout="fp32") for p in params]
    foreach_step(spec, params, [torch.randn(p.shape, generator=gen).to(DEVICE) for p in params], states, step=1,
                 seed=6, lr=1e-2)
    for p, s in zip(params, states):
        assert torch.equal(bits(s["written"]), fp32_bits_of_weight(p))


def test_stored_is_the_value_itself_for_fp32_weights():
    spec = spec_of(PROBE, "stored_probe")
    w = torch.randn(16, 72, device=DEVICE)
    state = _probe_state(spec, w, "fp32")
    kernels.step(spec, w, torch.randn(w.shape, device=DEVICE), state, step=1, lr=1e-2)
    assert torch.equal(bits(state["written"]), bits(w))


def test_stochastic_stored_param_rounds_differently_from_nearest():
    """Not nearest in disguise: with stochastic rounding, stored(param) rounds up or down by the element's bits."""
    spec = spec_of(PROBE, "stored_probe")
    w0 = (1 + torch.rand(16, 128)).to(torch.bfloat16)
    g = torch.randn(w0.shape)
    out = {}
    for rounding in ("stochastic", "nearest"):
        w = w0.clone().to(DEVICE)
        state = _probe_state(spec, w, "fp32")
        kernels.step(spec, w, g.to(DEVICE), state, step=1, seed=1, rounding=rounding, lr=1e-3)
        out[rounding] = bits(state["written"])
    assert (out["stochastic"] != out["nearest"]).any()


# ---------------------------------------------------------------------------
# The checker
# ---------------------------------------------------------------------------

REFUSED = [
    ("update {\n    param = stored(param, grad)\n}", "stored() takes 1 argument, got 2"),
    ("update {\n    param = param - lr * grad\n    stored = 1\n}", "'stored' is a built-in function and cannot be assigned"),
    ("hyper stored = 1\nupdate {\n    param = param - stored * grad\n}", "'stored' is a built-in function"),
    ("flag big = stored(lr) > 1\nupdate {\n    param = where(big, param, param - lr * grad)\n}",
     "stored() is per element"),
    ("require stored(lr) > 0, \"x\"\nupdate {\n    param = param - lr * grad\n}", "stored() is per element"),
    ("scalar s = 1\nupdate {\n    s = stored(lr)\n    param = param - s * grad\n}", "differs per element"),
    ("update {\n    param = param - lr * stored(grad > 0)\n}", "needs a number"),
]


@pytest.mark.parametrize("body, message", REFUSED, ids=[m for _, m in REFUSED])
def test_checker_refuses(body, message):
    text = f"optimizer bad\nhyper lr = 1e-3 in [0, inf)\n{body}\n"
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_spec(parse_spec(text, "bad.fopt"))


def test_stored_of_a_host_value_is_per_element():
    """stored(lr) depends on the weight's format and, stochastically, on the element: never hoisted to the host."""
    spec = spec_of("optimizer h\nhyper lr = 1e-3 in [0, inf)\nupdate {\n    param = param - stored(lr) * grad\n}\n",
                   "h")
    low = lower(spec, ())
    assert [i.op for i in low.elem].count("stored") == 1
    w = torch.ones(8, 64).to(torch.bfloat16).to(DEVICE)
    kernels.step(spec, w, torch.ones(8, 64, device=DEVICE), {}, step=1, rounding="nearest", lr=1.0 / 3)
    assert torch.equal(w.float().cpu(), torch.full((8, 64), 1 - float(torch.tensor(1.0 / 3).to(torch.bfloat16))
                                                   ).to(torch.bfloat16).float())
