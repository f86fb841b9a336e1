"""forge_dsl.kernels.triton_lib (Triton load/store helpers) against forge_dsl.kernels.layouts (torch).

Without a GPU the kernels run in the Triton interpreter (TRITON_INTERPRET=1,
set below before triton is imported); with one they are compiled and run on
it, and compared with the same CPU torch reference, so a GPU run checks that
interpreter and GPU agree bit for bit. `test_stochastic_golden_digest` pins
the stochastic-rounding bits to a digest computed in the interpreter, so the
GPU run also checks the hash (random_bits) gives the same bits on both.

Test kernels use small shapes and big tiles: the interpreter costs a few ms per
program.
"""

from __future__ import annotations

import hashlib
import numpy as np
import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from forge_dsl.kernels import layouts as L  # noqa: E402
from forge_dsl.kernels.kernel_calls import rounding_code  # noqa: E402
from forge_dsl.kernels import state_lib, tile_lib  # noqa: E402
from forge_dsl.kernels.layouts import StateLayout  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"

# ---------------------------------------------------------------------------
# test kernels
# ---------------------------------------------------------------------------


@triton.jit
def _weight_kernel(src, dst, n_rows, n_cols, seed, delta,
                   SRC_BF16: tl.constexpr, W_BF16: tl.constexpr, STOCHASTIC: tl.constexpr,
                   ADD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs, mask = tile_lib.tile_offsets(offs_n, offs_k, n_rows, n_cols)
    w = tile_lib.load_weight(src, offs, mask, SRC_BF16)
    if ADD:
        w = w + delta
    tile_lib.store_weight(dst, w, offs, mask, seed, W_BF16, STOCHASTIC)


@triton.jit
def _state_store_kernel(src, q, scale, n_rows, n_cols, n_blocks,
                        LAYOUT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(1) * BLOCK_K
    offs_k = k_start + tl.arange(0, BLOCK_K)
    offs, mask = tile_lib.tile_offsets(offs_n, offs_k, n_rows, n_cols)
    scale_offs = state_lib.block_scale_offsets(offs_n, k_start, n_blocks, BLOCK_K)
    x = tl.load(src + offs, mask=mask, other=0.0)
    # NIBBLE_WORDS False: read only by the 4-bit layouts (tests/kernels/test_int4.py)
    state_lib.store_state(q, scale, x, offs, mask, scale_offs, LAYOUT, False, BLOCK_N, BLOCK_K)


@triton.jit
def _state_load_kernel(q, scale, out, n_rows, n_cols, n_blocks,
                       LAYOUT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(1) * BLOCK_K
    offs_k = k_start + tl.arange(0, BLOCK_K)
    offs, mask = tile_lib.tile_offsets(offs_n, offs_k, n_rows, n_cols)
    scale_offs = state_lib.block_scale_offsets(offs_n, k_start, n_blocks, BLOCK_K)
    x = state_lib.load_state(q, scale, offs, mask, scale_offs, LAYOUT, False, BLOCK_N, BLOCK_K)
    tl.store(out + offs, x, mask=mask)


@triton.jit
def _state_update_kernel(q, scale, n_rows, n_cols, n_blocks, mult,
                         LAYOUT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """In place: load → multiply → store (the shape of an optimizer step)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(1) * BLOCK_K
    offs_k = k_start + tl.arange(0, BLOCK_K)
    offs, mask = tile_lib.tile_offsets(offs_n, offs_k, n_rows, n_cols)
    scale_offs = state_lib.block_scale_offsets(offs_n, k_start, n_blocks, BLOCK_K)
    x = state_lib.load_state(q, scale, offs, mask, scale_offs, LAYOUT, False, BLOCK_N, BLOCK_K)
    state_lib.store_state(q, scale, x * mult, offs, mask, scale_offs, LAYOUT, False, BLOCK_N, BLOCK_K)


# ---------------------------------------------------------------------------
# launch wrappers (CPU tensors in, CPU tensors out)
# ---------------------------------------------------------------------------


def _grid(rows, cols, bn, bk):
    return (triton.cdiv(rows, bn), triton.cdiv(cols, bk))


def run_weight(src, *, out_bf16=True, stochastic=False, seed=0, delta=None, block=(32, 256), pairs=None):
    """src: 2-D fp32 or bf16 CPU tensor → dst (bf16 or fp32) CPU tensor.

    stochastic: with the STOCHASTIC code the library launches pick for this many columns
    (`kernel_calls.rounding_code`: one hash per two elements when even); pairs=False forces one per element."""
    rows, cols = src.shape
    code = rounding_code("stochastic" if stochastic else "nearest", cols)
    if stochastic and pairs is False:
        code = 1  # ROUND_STOCHASTIC
    src_bf16 = src.dtype == torch.bfloat16
    s = src.to(DEVICE).contiguous()
    s_arg = s.view(torch.int16) if src_bf16 else s
    dst = torch.empty(rows, cols, dtype=torch.bfloat16 if out_bf16 else torch.float32, device=DEVICE)
    d_arg = dst.view(torch.int16) if out_bf16 else dst
    bn, bk = block
    _weight_kernel[_grid(rows, cols, bn, bk)](
        s_arg, d_arg, rows, cols, seed, 0.0 if delta is None else float(delta),
        SRC_BF16=src_bf16, W_BF16=out_bf16, STOCHASTIC=code, ADD=delta is not None,
        BLOCK_N=bn, BLOCK_K=bk)
    return dst.cpu()


def _storage_arg(t, layout):
    return t.view(torch.int16) if layout == StateLayout.BF16 else t


PAD = 96  # sentinel tail after the storage and the scales: catches out-of-bounds stores
SENTINEL = {torch.float32: 4096.0, torch.bfloat16: 4096.0, torch.int8: 0x55, torch.uint8: 0xAA}


def _alloc_storage(rows, cols, layout, scale_dtype=torch.float32):
    """Storage and scale buffers with a sentinel-filled tail past the real tensor."""
    dt = L.storage_dtype(layout)
    qbuf = torch.full((rows * cols + PAD,), SENTINEL[dt], dtype=dt, device=DEVICE)
    sbuf = torch.full((rows * L.n_blocks(cols) + PAD,), -7.0, dtype=scale_dtype, device=DEVICE)
    return qbuf, sbuf


def scale_arg(t):
    """Block scales as the kernels take them (`checks.bind_states`): float32, or bf16 as its int16 view."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def sbits(t):
    """Block scales' bit patterns (int32 for float32, int16 for bf16)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else fbits(t)


def run_state_store(x, layout, block=(32, 128), scale_dtype=torch.float32):
    """x: 2-D fp32 CPU → (q [rows, cols], scale [rows, nb] or None, qbuf, sbuf) CPU."""
    rows, cols = x.shape
    nb = L.n_blocks(cols)
    qbuf, sbuf = _alloc_storage(rows, cols, layout, scale_dtype)
    bn, bk = block
    _state_store_kernel[_grid(rows, cols, bn, bk)](
        x.to(DEVICE).contiguous(), _storage_arg(qbuf, layout), scale_arg(sbuf), rows, cols, nb,
        LAYOUT=int(layout), BLOCK_N=bn, BLOCK_K=bk)
    qbuf, sbuf = qbuf.cpu(), sbuf.cpu()
    q = qbuf[: rows * cols].reshape(rows, cols)
    scale = sbuf[: rows * nb].reshape(rows, nb) if layout in (StateLayout.INT8, StateLayout.UINT8_SQRT) else None
    return q, scale, qbuf, sbuf


def run_state_load(q, scale, layout, block=(32, 128)):
    rows, cols = q.shape
    nb = L.n_blocks(cols)
    qd = q.to(DEVICE).contiguous()
    sd = scale.to(DEVICE).contiguous() if scale is not None else qd
    out = torch.full((rows, cols), 777.0, device=DEVICE)
    bn, bk = block
    _state_load_kernel[_grid(rows, cols, bn, bk)](
        _storage_arg(qd, layout), scale_arg(sd), out, rows, cols, nb, LAYOUT=int(layout), BLOCK_N=bn, BLOCK_K=bk)
    return out.cpu()


def run_state_update(q, scale, layout, mult, block=(32, 128)):
    rows, cols = q.shape
    nb = L.n_blocks(cols)
    qd = q.to(DEVICE).contiguous().clone()
    sd = scale.to(DEVICE).contiguous().clone() if scale is not None else qd
    bn, bk = block
    _state_update_kernel[_grid(rows, cols, bn, bk)](
        _storage_arg(qd, layout), scale_arg(sd), rows, cols, nb, float(mult), LAYOUT=int(layout), BLOCK_N=bn,
        BLOCK_K=bk)
    return qd.cpu(), (sd.cpu() if scale is not None else None)


def bits16(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def fbits(t):
    return t.contiguous().view(torch.int32)


# ---------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------


def hashed_u32(n, salt):
    """Deterministic pseudo-random uint32 values (as int64), the same on every machine and torch version."""
    i = torch.arange(n, dtype=torch.int64) + salt * 1_000_003
    h = (i * 2654435761 + 0x9E3779B9) & 0xFFFFFFFF
    h = h ^ (h >> 15)
    h = (h * 2246822519) & 0xFFFFFFFF
    h = h ^ (h >> 13)
    h = (h * 3266489917) & 0xFFFFFFFF
    return h ^ (h >> 16)


def as_f32_bits(u):
    """int64 values in [0, 2**32) → float32 with those bits."""
    return torch.where(u >= 2**31, u - 2**32, u).to(torch.int32).view(torch.float32)


def bf16_special_inputs():
    """fp32 values covering every rounding case: random bit patterns (all classes), ties, subnormals, specials."""
    g = torch.Generator().manual_seed(0)
    rand_bits = torch.randint(-(2**31), 2**31, (16384,), generator=g, dtype=torch.int64).to(torch.int32)
    # ties: low 16 bits exactly 0x8000, with bit 16 even and odd
    hi = torch.randint(0, 2**16, (4096,), generator=g, dtype=torch.int64)
    ties = as_f32_bits((hi << 16) | 0x8000)
    near_ties = as_f32_bits(torch.cat([(hi << 16) | 0x7FFF, (hi << 16) | 0x8001]))
    # subnormals and tiny normals
    sub = as_f32_bits(torch.randint(0, 2**24, (2048,), generator=g, dtype=torch.int64)
                      | (torch.randint(0, 2, (2048,), generator=g, dtype=torch.int64) << 31))
    specials = torch.tensor([
        0x00000000, 0x80000000,  # ±0
        0x7F800000, 0xFF800000,  # ±inf
        0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F80FFFF, 0xFF812345,  # NaNs
        0x7F7FFFFF, 0xFF7FFFFF,  # largest finite: round to ±inf
        0x7F7F7FFF, 0x7F7F8000, 0x7F7E8000,  # below / tie near the top
        0x00000001, 0x80000001, 0x00008000, 0x00018000, 0x007FFFFF, 0x00800000,  # subnormal edge cases
        0x3F808000, 0x3F818000, 0x3F800001, 0xBF808000,  # ties at 1.0
    ], dtype=torch.int64)
    vals = torch.cat([rand_bits.view(torch.float32), ties, near_ties, sub, as_f32_bits(specials),
                      torch.randn(8192, generator=g) * 3.0])
    n = vals.numel()
    cols = 1024
    rows = -(-n // cols)
    vals = torch.cat([vals, torch.zeros(rows * cols - n)])
    return vals.reshape(rows, cols)


# ---------------------------------------------------------------------------
# (a) bf16 round to nearest even
# ---------------------------------------------------------------------------


def test_bf16_rne_store_matches_reference_and_torch():
    x = bf16_special_inputs()
    out = bits16(run_weight(x, out_bf16=True, stochastic=False, block=(16, 512)))
    ref = L.bf16_round_nearest_bits(x)
    assert torch.equal(out, ref)
    # NaN → the canonical quiet NaN
    nan = torch.isnan(x)
    assert nan.sum() >= 7
    assert (out[nan] == 0x7FFF).all()
    # torch's own conversion rounds to nearest even; its NaN bits depend on the CPU code path
    tb = x.to(torch.bfloat16).view(torch.int16)
    assert torch.equal(out[~nan], tb[~nan])
    assert torch.isnan(x.to(torch.bfloat16)[nan].float()).all()
    # the infinities and the round-to-inf cases
    inf_in = torch.isinf(x)
    assert torch.isinf(L.bf16_from_bits(out[inf_in])).all()


def test_bf16_load_store_roundtrip_and_fp32_weights():
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(40, 300, generator=g) * 10).to(torch.bfloat16)
    w.view(torch.int16)[0, :4] = torch.tensor([0x7F80, -128, 0x0001, -32768], dtype=torch.int16)  # inf, -inf, subnormal, -0
    back = run_weight(w, out_bf16=True, stochastic=False, block=(16, 256))
    assert torch.equal(bits16(back), bits16(w))
    # bf16 → fp32 load is exact
    f = run_weight(w, out_bf16=False, block=(16, 256))
    assert torch.equal(fbits(f), fbits(w.float()))
    assert torch.equal(fbits(L.bf16_from_bits(w.view(torch.int16))), fbits(w.float()))
    # fp32 → fp32 copy is exact (stochastic flag ignored for fp32 weights)
    x = torch.randn(33, 130, generator=g)
    assert torch.equal(fbits(run_weight(x, out_bf16=False, stochastic=True, seed=3, block=(16, 256))), fbits(x))


# ---------------------------------------------------------------------------
# (b) stochastic rounding: unbiased, and small updates survive
# ---------------------------------------------------------------------------


def test_stochastic_rounding_is_unbiased():
    # fp32 values strictly between two bf16 neighbours, with different fractions of the gap
    low16 = [0x0001, 0x1000, 0x4000, 0x5555, 0x7FFF, 0x8000, 0xC000, 0xFFF0]
    his = [0x3F80, 0x4049, 0xBF80, 0x3A12, 0xC2F6, 0x0003, 0x7F00, 0x8001]  # ±1, π, tiny, -123, subnormal, big
    vals = as_f32_bits(torch.tensor([(h << 16) | lo for h, lo in zip(his, low16)], dtype=torch.int64))
    n_idx, seeds = 4096, [0, 12345, 2**33 + 5]
    x = vals[:, None].expand(len(vals), n_idx).contiguous()
    up = torch.zeros(len(vals))
    for s in seeds:
        out = bits16(run_weight(x, stochastic=True, seed=s, block=(8, 4096)))
        trunc = (fbits(x) >> 16).to(torch.int16)
        rounded_up = out != trunc
        assert ((out == trunc) | (out == trunc + 1)).all()  # only the two neighbours
        up += rounded_up.sum(1).to(torch.float32)
    n = n_idx * len(seeds)
    lo = L.bf16_from_bits((fbits(vals) >> 16).to(torch.int16)).double()
    hi = L.bf16_from_bits(((fbits(vals) >> 16) + 1).to(torch.int16)).double()
    gap = hi - lo
    p = torch.tensor(low16, dtype=torch.float64) / 65536.0  # exact P(round away from zero)
    p_hat = up.double() / n
    # the count of round-ups is Binomial(n, p): std of the mean of the rounded values is |gap| * sqrt(p(1-p)/n)
    sigma = torch.sqrt(p * (1 - p) / n)
    assert ((p_hat - p).abs() <= 5 * sigma + 1e-12).all(), (p_hat, p)
    mean_value = lo + gap * p_hat
    assert ((mean_value - vals.double()).abs() <= 5 * gap.abs() * sigma + 1e-300).all()


def test_stochastic_rounding_keeps_small_updates():
    rows, cols = 32, 256
    ulp = 2.0 ** -7  # bf16 spacing in [1, 2)
    delta = ulp / 4  # under half an ulp: round to nearest drops it every time
    steps = 64
    w_sr = torch.ones(rows, cols, dtype=torch.bfloat16)
    w_rn = w_sr.clone()
    for k in range(steps):
        w_sr = run_weight(w_sr, stochastic=True, seed=1000 + k, delta=delta, block=(32, 256))
        w_rn = run_weight(w_rn, stochastic=False, delta=delta, block=(32, 256))
    assert (w_rn == 1.0).all()  # round to nearest: the update vanishes
    expected = 1.0 + steps * delta  # 1.125
    # per step the rounding error is zero-mean with variance <= ulp**2 / 4; the
    # mean over rows*cols independent elements has std <= sqrt(steps) * ulp / 2 / sqrt(rows*cols)
    sigma = math.sqrt(steps) * ulp / 2 / math.sqrt(rows * cols)
    mean = w_sr.double().mean().item()
    assert abs(mean - expected) <= 5 * sigma, (mean, expected, sigma)


# ---------------------------------------------------------------------------
# (c) random bits depend only on (seed, index)
# ---------------------------------------------------------------------------


def test_stochastic_bits_independent_of_tile_shape():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(72, 136, generator=g)
    outs = [bits16(run_weight(x, stochastic=True, seed=99, block=b)) for b in [(8, 64), (32, 128), (128, 256)]]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    # a different seed changes bits (for values not exactly representable)
    other = bits16(run_weight(x, stochastic=True, seed=100, block=(32, 128)))
    assert (other != outs[0]).float().mean() > 0.3
    # and every result is one of the two bf16 neighbours
    trunc = (fbits(x) >> 16).to(torch.int16)
    assert ((outs[0] == trunc) | (outs[0] == trunc + 1)).all()


# Digest of the stochastic-rounding bits of fixed inputs and seeds, computed in
# the Triton interpreter; the GPU must give the very same bits.
STOCHASTIC_GOLDEN = "bf41310158acf1ee"


def test_stochastic_golden_digest():
    x = as_f32_bits(hashed_u32(64 * 320, salt=7) & 0xBFFFFFFF).reshape(64, 320)  # finite, mixed magnitudes
    x = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    h = hashlib.sha256()
    for seed in [0, 1, 7, 2**31 - 1, 2**31 + 3, 2**40 + 12345, 2**63 - 1]:
        h.update(bits16(run_weight(x, stochastic=True, seed=seed, block=(32, 128))).numpy().tobytes())
    digest = h.hexdigest()[:16]
    assert digest == STOCHASTIC_GOLDEN, f"stochastic rounding bits changed: digest {digest}"


# ---------------------------------------------------------------------------
# (d) state layouts: Triton store/load == layouts.quantize/dequantize
# ---------------------------------------------------------------------------


def state_inputs(rows, cols, layout, seed):
    g = torch.Generator().manual_seed(seed)
    # rows with very different magnitudes, a few exact-zero blocks and -0.0
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-6, 3, rows)[:, None]
    if cols >= 64:
        x[0, :64] = 0.0  # zero block
        x[rows // 2, -min(cols, 8):] = 0.0
    x[-1, 0] = -0.0
    if layout == StateLayout.UINT8_SQRT:
        x = x.abs() ** 1.5
        x[rows // 2, 1::7] = -x[rows // 2, 1::7]  # negatives are clamped to 0
    # some values exactly at code boundaries
    x.view(-1)[5::97] = x.view(-1)[5::97].round()
    return x


SHAPES = [(72, 136), (5, 200), (3, 64), (1, 1000)]
BLOCKS = [(32, 128), (8, 256)]


# (layout, scale dtype): the 8-bit layouts with both scale formats (4-bit: test_int4.py)
STATE_CASES = [(StateLayout.FP32, None), (StateLayout.BF16, None)] + [
    (layout, dt) for layout in (StateLayout.INT8, StateLayout.UINT8_SQRT) for dt in L.SCALE_DTYPES]


def _case_id(case):
    layout, dt = case
    return layout.name if dt is None else f"{layout.name}-{str(dt).removeprefix('torch.')}"


@pytest.mark.parametrize("case", STATE_CASES, ids=_case_id)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_state_roundtrip_matches_layouts(case, shape):
    layout, scale_dtype = case
    scale_dtype = scale_dtype or torch.float32
    rows, cols = shape
    block = BLOCKS[(rows + cols) % 2]
    x = state_inputs(rows, cols, layout, seed=rows * 1000 + cols)
    q, scale, qbuf, sbuf = run_state_store(x, layout, block=block, scale_dtype=scale_dtype)
    ref_q, ref_scale = L.quantize(x, layout, scale_dtype=scale_dtype)
    assert q.dtype == L.storage_dtype(layout)
    assert torch.equal(bits16(q), bits16(ref_q)) if layout != StateLayout.FP32 else torch.equal(fbits(q), fbits(ref_q))
    if ref_scale is not None:
        assert ref_scale.dtype == scale.dtype == scale_dtype
        assert torch.equal(sbits(scale), sbits(ref_scale))
        assert (sbuf[rows * L.n_blocks(cols):] == -7.0).all()  # nothing written past the scales
    dt = L.storage_dtype(layout)
    assert (qbuf[rows * cols:] == SENTINEL[dt]).all()  # nothing written past the storage

    out = run_state_load(q, scale, layout, block=block)
    ref_out = L.dequantize(ref_q, ref_scale, layout)
    assert torch.equal(fbits(out), fbits(ref_out))

    # load → transform → store in place, against the torch composition
    q2, s2 = run_state_update(q, scale, layout, mult=0.75, block=block)
    ref_q2, ref_s2 = L.quantize(ref_out * 0.75, layout, scale_dtype=scale_dtype)
    assert torch.equal(bits16(q2) if layout != StateLayout.FP32 else fbits(q2),
                       bits16(ref_q2) if layout != StateLayout.FP32 else fbits(ref_q2))
    if ref_s2 is not None:
        assert torch.equal(sbits(s2), sbits(ref_s2))


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # 0 * inf in the interpreter's numpy
@pytest.mark.parametrize("scale_dtype", L.SCALE_DTYPES, ids=str)
@pytest.mark.parametrize("layout", [StateLayout.INT8, StateLayout.UINT8_SQRT], ids=lambda l: l.name)
def test_int8_zero_and_nonfinite_blocks(layout, scale_dtype):
    rows, cols = 5, 200
    x = torch.rand(rows, cols, generator=torch.Generator().manual_seed(4)) + 0.5
    x[0, :] = 0.0  # a whole zero row: 4 zero blocks incl. the ragged one
    x[1, 64:128] = -0.0
    x[2, 3] = float("nan")  # block (2, 0) → NaN on read
    x[3, 130] = float("inf")  # block (3, 2) → NaN on read
    x.view(torch.int32)[4, 70] = -0x3FFFFF  # a NaN with the sign bit (0xFFC00001): block (4, 1) → NaN
    q, scale, _, _ = run_state_store(x, layout, block=(8, 256), scale_dtype=scale_dtype)
    ref_q, ref_scale = L.quantize(x, layout, scale_dtype=scale_dtype)
    assert torch.equal(bits16(q), bits16(ref_q))
    assert torch.equal(sbits(scale), sbits(ref_scale))
    assert (scale[0] == 0).all() and (q[0] == 0).all() and scale[1, 1] == 0
    f32 = fbits(scale.float())  # bf16 → fp32 is exact: 0x7FC0 → 0x7FC00000
    assert f32[2, 0] == 0x7FC00000 and f32[4, 1] == 0x7FC00000  # one NaN pattern
    assert torch.isinf(scale[3, 2])
    out = run_state_load(q, scale, layout, block=(8, 256))
    assert torch.equal(fbits(out[0]), torch.zeros(cols, dtype=torch.int32))  # exact +0
    assert (out[1, 64:128] == 0).all()
    assert torch.isnan(out[2, :64]).all() and not torch.isnan(out[2, 64:]).any()
    assert torch.isnan(out[3, 128:192]).all() and not torch.isnan(out[3, :128]).any()
    assert torch.isnan(out[4, 64:128]).sum() == 64 and torch.isnan(out[4]).sum() == 64
    ref_out = L.dequantize(ref_q, ref_scale, layout)
    assert torch.equal(torch.isnan(out), torch.isnan(ref_out))
    fin = ~torch.isnan(out)
    assert torch.equal(fbits(out[fin]), fbits(ref_out[fin]))


def _next_f32(x: torch.Tensor, direction: float) -> torch.Tensor:
    return torch.nextafter(x, torch.full_like(x, direction))


@pytest.mark.parametrize("scale_dtype", L.SCALE_DTYPES, ids=str)
def test_sqrt_codes_at_every_threshold(scale_dtype):
    """UINT8_SQRT codes at, just below and just above each of the 255 half-way points: the
    kernel (approximate root + one exact comparison) gives the reference's codes bit for bit,
    and those are round-half-up of 255·sqrt(t) computed in float64 (apart from the points
    within a few ulps of a half-way point, where they may go either way by 1e-4 of a code)."""
    k = torch.arange(1, 256, dtype=torch.float64)
    theta = L._SQRT_THRESHOLDS
    t = torch.cat([theta, _next_f32(theta, 0.0), _next_f32(theta, 2.0),
                   torch.rand(2000, generator=torch.Generator().manual_seed(11)), torch.tensor([0.0, 1e-30, 1.0])])
    t = t.to(torch.float32)
    per_row = 63  # each row: 63 values and one 1.0, so scale = 1 and t = x exactly
    pad = (-t.numel()) % per_row
    t = torch.cat([t, torch.zeros(pad)])
    x = torch.cat([t.reshape(-1, per_row), torch.ones(t.numel() // per_row, 1)], dim=1)
    q, scale, _, _ = run_state_store(x, StateLayout.UINT8_SQRT, block=(32, 64), scale_dtype=scale_dtype)
    ref_q, ref_scale = L.quantize(x, StateLayout.UINT8_SQRT, scale_dtype=scale_dtype)
    assert torch.equal(sbits(scale), sbits(ref_scale)) and (scale == 1.0).all()
    assert torch.equal(bits16(q), bits16(ref_q))

    # the reference against float64: each threshold is within 4e-7 (relative) of its half-way point
    assert torch.all(((theta.double() / ((k - 0.5) / 255) ** 2) - 1).abs() < 4e-7)
    assert torch.all(theta[1:] > theta[:-1])
    codes = ref_q[:, :per_row].reshape(-1).double()
    u = 255 * torch.sqrt(x[:, :per_row].reshape(-1).double())
    exact = torch.floor(u + 0.5)
    near_half = (u - torch.floor(u) - 0.5).abs() < 1e-4
    assert torch.equal(codes[~near_half], exact[~near_half])
    assert ((codes - u).abs() <= 0.5 + 1e-4).all()
    assert near_half.sum() >= 3 * 255 - 5  # the thresholds and their neighbours were exercised


@pytest.mark.filterwarnings("ignore:overflow encountered in divide")  # 1 / tiny in the interpreter's numpy
@pytest.mark.parametrize("layout,tiny,small", [(StateLayout.INT8, 1e-37, 1e-36),
                                               (StateLayout.UINT8_SQRT, 1e-39, 1e-38)],
                         ids=["INT8", "UINT8_SQRT"])
@pytest.mark.parametrize("scale_dtype", L.SCALE_DTYPES, ids=str)
def test_int8_tiny_scale_blocks_read_back_as_zeros(layout, tiny, small, scale_dtype):
    """A block whose scale's reciprocal overflows fp32 stores codes 0 (reads back as zeros);
    one a little larger is still encoded. Kernel and reference agree bit for bit."""
    x = torch.rand(2, 128, generator=torch.Generator().manual_seed(5)) + 0.25
    x[0, :64] *= tiny / x[0, :64].max()
    x[1, :64] *= small / x[1, :64].max()
    q, scale, _, _ = run_state_store(x, layout, block=(8, 128), scale_dtype=scale_dtype)
    ref_q, ref_scale = L.quantize(x, layout, scale_dtype=scale_dtype)
    assert torch.equal(bits16(q), bits16(ref_q)) and torch.equal(sbits(scale), sbits(ref_scale))
    assert (q[0, :64] == 0).all() and scale[0, 0] > 0
    assert (L.dequantize(ref_q, ref_scale, layout)[0, :64] == 0).all()
    assert (q[1, :64] != 0).sum() > 32 and (q[:, 64:] != 0).all()


@pytest.mark.filterwarnings("ignore:overflow encountered")  # 127 / the largest bf16 in the interpreter's numpy
@pytest.mark.parametrize("layout", [StateLayout.INT8, StateLayout.UINT8_SQRT], ids=lambda l: l.name)
def test_bf16_scales_round_up_and_saturate(layout):
    """bf16 block scales: the block maximum rounded UP to a bf16 (the next one where its low 16 bits are not
    zero, itself where they are); a maximum above the largest finite bf16 saturates to it (not inf, which would
    poison the block), and its codes stay in range; a subnormal maximum stays > 0. Kernel == torch, bit for bit,
    and the codes are those of the stored (rounded) scale: x' follows the scale."""
    big = torch.finfo(torch.float32).max
    x = torch.rand(6, 128, generator=torch.Generator().manual_seed(9)) + 0.1
    x[0, :64] *= 1.0 / x[0, :64].max()
    x[0, 5] = 1.0 + 2.0**-23  # rounds up to 1 + 2**-7
    x[1, :64] *= 1.0 / x[1, :64].max()  # exactly 1: a bf16 already
    x[2, :64] *= big / x[2, :64].max()  # FLT_MAX: above the largest finite bf16
    x[2, 64:] = 3.3895313892515355e38  # the largest finite bf16, exactly
    x[3, :64] = x[3, :64] * 1e-39  # subnormal maximum (codes 0: its reciprocal overflows)
    x[4, 64:] = torch.nextafter(torch.tensor(2.0**-126), torch.tensor(0.0))  # largest subnormal everywhere
    if layout == StateLayout.INT8:
        x[5] = -x[5]
        x[2, 7] = -big
    q, scale, _, _ = run_state_store(x, layout, block=(8, 128), scale_dtype=torch.bfloat16)
    ref_q, ref_scale = L.quantize(x, layout, scale_dtype=torch.bfloat16)
    assert torch.equal(bits16(q), bits16(ref_q)) and torch.equal(sbits(scale), sbits(ref_scale))
    s = scale.view(torch.int16).to(torch.int32)
    m = x.abs().reshape(6, 2, 64).amax(-1)
    amax = fbits(m)
    want = (amax >> 16) + ((amax & 0xFFFF) != 0).to(torch.int32)
    assert torch.equal(s, want.clamp_max(0x7F7F))
    assert s[0, 0] == 0x3F81 and s[1, 0] == 0x3F80 and s[2, 0] == 0x7F7F and s[2, 1] == 0x7F7F
    saturated = want > 0x7F7F
    assert saturated.sum() == 1 and saturated[2, 0]
    assert (scale.float()[~saturated] >= m[~saturated]).all()
    assert (scale.float()[~saturated].double() <= m[~saturated].double() * (1 + 2.0**-7)).all()
    assert torch.isfinite(scale.float()).all() and (scale.float() > 0).all()
    out = run_state_load(q, scale, layout, block=(8, 128))
    assert torch.equal(fbits(out), fbits(L.dequantize(ref_q, ref_scale, layout)))
    assert torch.isfinite(out).all()
    top = 127 if layout == StateLayout.INT8 else 255
    assert q[2, :64].to(torch.int32).abs().max() == top  # saturated: the largest code, no wrap-around
    assert (out[3, :64] == 0).all()
    # away from saturation x' is within half a step of the STORED scale
    ok = torch.ones(6, 128, dtype=torch.bool)
    ok[2, :64] = False
    ok[3, :64] = ok[4, 64:] = False  # reciprocals overflow: codes 0
    if layout == StateLayout.INT8:
        err = (out.double() - x.double()).abs()
        step = scale.double().repeat_interleave(64, dim=1) / 127
        assert (err[ok] <= step[ok] / 2 * (1 + 1e-6)).all()


def test_bf16_state_rne_matches_weights():
    x = bf16_special_inputs()[:8]
    q, _, _, _ = run_state_store(x, StateLayout.BF16, block=(8, 512))
    assert torch.equal(bits16(q), L.bf16_round_nearest_bits(x))


# ---------------------------------------------------------------------------
# error bounds (torch side; the Triton side is bit-identical)
# ---------------------------------------------------------------------------


def _bound_inputs(layout):
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(16, 640, generator=g) * torch.logspace(-30, 30, 16)[:, None],
          torch.rand(8, 256, generator=g) ** 8,
          (torch.randn(8, 200, generator=g) * 1e-3)]
    if layout == StateLayout.UINT8_SQRT:
        xs = [x.abs() for x in xs]
    return xs


@pytest.mark.parametrize("scale_dtype", L.SCALE_DTYPES, ids=str)
def test_int8_error_bound(scale_dtype):
    """Half a step of the STORED scale (bf16 scales: the block maximum rounded up, by less than 1 + 2**-7)."""
    for x in _bound_inputs(StateLayout.INT8):
        q, s = L.quantize(x, StateLayout.INT8, scale_dtype=scale_dtype)
        d = L.dequantize(q, s, StateLayout.INT8).double()
        se = s.double().repeat_interleave(64, 1)[:, : x.shape[1]]
        err = (d - x.double()).abs()
        # half a step plus a few fp32 roundings of scale-sized quantities
        assert (err <= se / 254 + 4 * 2.0 ** -24 * se).all()
        assert q.abs().max() <= 127
        # the block's absmax is represented almost exactly (code ±127; bf16 scales: 127 M / scale > 126.01)
        top = 127 if scale_dtype == torch.float32 else 126
        assert (q.abs().reshape(-1) >= top).sum() >= s.numel() - (s == 0).sum()


@pytest.mark.parametrize("scale_dtype", L.SCALE_DTYPES, ids=str)
def test_uint8_sqrt_error_bound(scale_dtype):
    for x in _bound_inputs(StateLayout.UINT8_SQRT):
        q, s = L.quantize(x, StateLayout.UINT8_SQRT, scale_dtype=scale_dtype)
        d = L.dequantize(q, s, StateLayout.UINT8_SQRT).double()
        se = s.double().repeat_interleave(64, 1)[:, : x.shape[1]]
        xd = x.double()
        # the two codes that bracket x: k = floor(sqrt(x/s) * 255) and k + 1
        u = torch.sqrt(torch.where(se > 0, xd / se, torch.zeros_like(xd))) * 255
        k = torch.floor(u).clamp(0, 254)
        half_gap = se * ((k + 1) ** 2 - k**2) / 255**2 / 2
        err = (d - xd).abs()
        # rounding happens on sqrt: up to scale/(4*255**2) past half the gap, + fp32 slop
        slop = se / (4 * 255**2) + 8 * 2.0 ** -24 * se
        assert (err <= half_gap + slop).all()
        assert (d >= 0).all()
        # and the code is the nearest one in the sqrt domain
        assert ((q.double() - u).abs() <= 0.5 + 1e-4).all()


# ---------------------------------------------------------------------------
# layouts.py (pure torch)
# ---------------------------------------------------------------------------


def test_resolve_layout_rules():
    R = L.resolve_layout
    assert R("fp32", False, (10, 100)) == StateLayout.FP32
    assert R("bf16", True, (10, 3)) == StateLayout.BF16
    assert R("int8", False, (10, 100)) == StateLayout.INT8
    assert R("int8", True, (10, 100)) == StateLayout.UINT8_SQRT
    assert R("int8", False, (64,)) == StateLayout.INT8
    assert R("int8", True, (2, 3, 64)) == StateLayout.UINT8_SQRT
    # states smaller than a block stay fp32: the last dim decides
    assert R("int8", False, (1000, 63)) == StateLayout.FP32
    assert R("int8", True, (63,)) == StateLayout.FP32
    assert R("int8", True, ()) == StateLayout.FP32
    assert R("int8", False, (63, 64)) == StateLayout.INT8
    for bad in ["int2", "FP32", "float32", "", None]:
        with pytest.raises(ValueError, match="unknown state layout"):
            R(bad, False, (10, 100))


def test_storage_dtypes_rows_blocks():
    assert [L.storage_dtype(l) for l in StateLayout] == [torch.float32, torch.bfloat16, torch.int8, torch.uint8,
                                                         torch.int8, torch.uint8]
    assert [int(l) for l in StateLayout] == [0, 1, 2, 3, 4, 5]
    assert tuple(c.value for c in (state_lib.LAYOUT_FP32, state_lib.LAYOUT_BF16, state_lib.LAYOUT_INT8, state_lib.LAYOUT_UINT8_SQRT,
                                   state_lib.LAYOUT_INT4, state_lib.LAYOUT_UINT4)) == (0, 1, 2, 3, 4, 5)
    assert state_lib.R255.value == L.R255 and state_lib.QBLOCK.value == L.BLOCK == 64
    assert state_lib.FLT_MAX.value == torch.finfo(torch.float32).max
    assert L.as_rows(torch.zeros(2, 3, 5)).shape == (6, 5)
    assert L.as_rows(torch.zeros(7)).shape == (1, 7)
    assert L.as_rows(torch.tensor(3.0)).shape == (1, 1)
    assert L.as_rows(torch.zeros(4, 0)).shape == (4, 0)
    t = torch.arange(12.0).reshape(3, 4)
    assert L.as_rows(t).data_ptr() == t.data_ptr()  # a view
    assert [L.n_blocks(c) for c in (1, 63, 64, 65, 128, 200)] == [1, 1, 1, 2, 2, 4]


def test_quantize_shapes_and_dtypes():
    x = torch.randn(2, 3, 70, dtype=torch.float64)
    q, s = L.quantize(x, StateLayout.INT8)
    assert q.shape == x.shape and q.dtype == torch.int8 and s.shape == (6, 2) and s.dtype == torch.bfloat16
    assert L.quantize(x, StateLayout.INT8, scale_dtype=torch.float32)[1].dtype == torch.float32
    assert L.dequantize(q, s, StateLayout.INT8).shape == x.shape
    q, s = L.quantize(x.abs().half(), StateLayout.UINT8_SQRT)
    assert q.dtype == torch.uint8 and s.shape == (6, 2)
    q, s = L.quantize(x, StateLayout.BF16)
    assert q.dtype == torch.bfloat16 and s is None
    assert torch.equal(L.dequantize(q, None, StateLayout.BF16), x.float().to(torch.bfloat16).float())
    q, s = L.quantize(x, StateLayout.FP32)
    assert q.dtype == torch.float32 and s is None
    q, s = L.quantize(torch.tensor(2.5), StateLayout.INT8)  # 0-dim: one ragged block
    assert q.shape == () and s.shape == (1, 1) and L.dequantize(q, s, StateLayout.INT8).item() == 2.5
    with pytest.raises(ValueError, match="scale shape"):
        L.dequantize(torch.zeros(3, 70, dtype=torch.int8), torch.zeros(3, 1), StateLayout.INT8)
    with pytest.raises(TypeError):
        L.dequantize(torch.zeros(3, 70, dtype=torch.uint8), torch.zeros(3, 2), StateLayout.INT8)
    with pytest.raises(ValueError, match="needs its block scale"):
        L.dequantize(torch.zeros(3, 70, dtype=torch.int8), None, StateLayout.INT8)


def test_int8_rounds_half_up_exactly():
    # scale 127 → inv = 1, y = x: ties go up (toward +inf); no double rounding just below 0.5
    below_half = float(torch.tensor(0.5 - 2.0**-25))  # floor(fl(y + 0.5)) would give 1 here
    vals = [127.0, 2.5, -2.5, 3.5, -3.5, 0.5, -0.5, below_half, -127.0, 126.49999]
    x = torch.zeros(1, 64)
    x[0, : len(vals)] = torch.tensor(vals)
    q, s = L.quantize(x, StateLayout.INT8)
    assert s.item() == 127.0
    assert q[0, : len(vals)].tolist() == [127, 3, -2, 4, -3, 1, 0, 0, -127, 126]
    # the same through the Triton store
    tq, ts, _, _ = run_state_store(x, StateLayout.INT8, block=(1, 64))
    assert torch.equal(tq, q) and torch.equal(ts, s)


def test_quantize_ragged_padding_does_not_affect_scale():
    x = torch.full((2, 70), -0.5)
    x[:, 64:] = torch.tensor([0.25, -0.125, 0.0, 0.0, 0.0, 0.1])
    _, s = L.quantize(x, StateLayout.INT8)
    assert s[:, 1].tolist() == [0.25, 0.25]
    _, s = L.quantize(x, StateLayout.UINT8_SQRT)
    assert s[:, 0].tolist() == [0.0, 0.0] and torch.equal(s[:, 1], torch.full((2,), 0.25))


def test_bf16_bits_helpers():
    x = bf16_special_inputs()
    b = L.bf16_round_nearest_bits(x)
    assert b.dtype == torch.int16
    fin = ~torch.isnan(x)
    assert torch.equal(b[fin], x.to(torch.bfloat16).view(torch.int16)[fin])
    assert (b[~fin] == 0x7FFF).all()
    # from_bits ∘ round is the identity on bf16 values
    y = L.bf16_from_bits(b)
    assert torch.equal(L.bf16_round_nearest_bits(y)[fin], b[fin])
    assert torch.equal(fbits(L.bf16_from_bits(b.view(torch.bfloat16))), fbits(b.view(torch.bfloat16).float()))


def _lowbias32(x: np.ndarray) -> np.ndarray:
    """lowbias32 in numpy on uint64 lanes, wrapped to 32 bits: an independent reference."""
    x = x.astype(np.uint64) & 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    x ^= x >> 16
    return x


def _random_bits_numpy(offs: np.ndarray, seed: int) -> np.ndarray:
    """`tile_lib.random_bits` in numpy: lowbias32 of a Weyl step of the index, keyed by the seed."""
    key = _lowbias32((_lowbias32(np.array([seed & 0xFFFFFFFF])) + 0x9E3779B9) & 0xFFFFFFFF)[0]
    return _lowbias32((offs.astype(np.uint64) * 0x9E3779B9 + key) & 0xFFFFFFFF)


def _random16_numpy(idx: np.ndarray, seed: int) -> np.ndarray:
    """`tile_lib.random16`: element e takes the low (e even) or high (e odd) half of the hash of e >> 1."""
    idx = idx.astype(np.uint64)
    return (_random_bits_numpy(idx >> np.uint64(1), seed) >> (np.uint64(16) * (idx & np.uint64(1)))) & 0xFFFF


def test_random_bits_uncorrelated_at_any_lag():
    """The 16 bits stochastic rounding uses show no correlation between elements a power of two
    (a row of W), or a few other strides, apart, nor between the two halves of one hash (lag 1):
    every lag's z-score over 2**22 elements below 5.

    A single lowbias32 round on index ^ key, without the Weyl step, fails this (|z| 6 to 13)."""
    n = 1 << 22
    idx = np.arange(n, dtype=np.uint64)
    lags = sorted({1 << k for k in range(21)} | {3, 5, 7, 96, 1000, 4095, 4097, 14336})
    for seed in [0, 1, 2, 2**31 + 3]:
        u = _random16_numpy(idx, seed).astype(np.float64) / 65536 - 0.5  # var 1/12
        for lag in lags:
            z = np.dot(u[:-lag], u[lag:]) * 12 / np.sqrt(n - lag)
            assert abs(z) < 5, (seed, lag, z)


@pytest.mark.parametrize("cols, pairs", [(136, None), (136, False), (135, None)])
def test_stochastic_rounding_draws_random16(cols, pairs):
    """The stochastic store adds `random16` of each element's index and truncates, with one hash per two
    neighbours (an even number of columns) or one per element (odd, or forced): the same bits either way."""
    rows, seed = 40, 2**31 + 77
    g = torch.Generator().manual_seed(cols)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 3, rows)[:, None]
    out = bits16(run_weight(x, stochastic=True, seed=seed, block=(16, 64), pairs=pairs))
    r16 = _random16_numpy(np.arange(rows * cols, dtype=np.uint64), seed).astype(np.int64)
    want = (fbits(x).to(torch.int64).reshape(-1) & 0xFFFFFFFF) + torch.from_numpy(r16)
    want = (want >> 16).to(torch.int16).reshape(rows, cols)  # finite inputs: no carry into the sign
    assert torch.equal(out, want)


@triton.jit
def _random_bits_kernel(out, seed, first, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK).to(tl.int64) + first
    tl.store(out + tl.arange(0, BLOCK), tile_lib.random_bits(offs, seed).to(tl.int64))


@pytest.mark.parametrize("seed", [0, 1, 7, 2**31 - 1, 2**31 + 3, 2**32 + 5, 2**40 + 12345])
def test_random_bits_match_a_numpy_reference(seed):
    """The stochastic-rounding bits, compiled or interpreted, equal lowbias32 computed in numpy."""
    first = 2**32 - 100  # the element index wraps at 2**32
    out = torch.zeros(256, dtype=torch.int64, device=DEVICE)
    _random_bits_kernel[(1,)](out, seed, first, BLOCK=256)
    offs = (np.arange(256, dtype=np.uint64) + np.uint64(first)) & 0xFFFFFFFF
    want = _random_bits_numpy(offs, seed)
    got = out.cpu().numpy().astype(np.uint64) & 0xFFFFFFFF
    assert np.array_equal(got, want)
