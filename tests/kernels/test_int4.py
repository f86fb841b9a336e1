"""The 4-bit state layouts (INT4 signed, UINT4 nonneg; `state_dtype="int4"`): the torch encoding against an
independent float64 nearest-value reference, the Triton helpers against the torch encoding bit for bit, the
kernels' steps, ForgeOptimizer against torch.optim.AdamW, state dicts, and the refusals.

Without a GPU the kernels run in the Triton interpreter (tests/conftest.py); with one they run compiled.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import forge_dsl  # noqa: E402
from forge_dsl import ForgeOptimizer, kernels  # noqa: E402
from forge_dsl.kernels import layouts as L  # noqa: E402
from forge_dsl.kernels import kernel_calls  # noqa: E402
from forge_dsl.kernels import state_lib, tile_lib  # noqa: E402
from forge_dsl.kernels.checks import bind_states  # noqa: E402
from forge_dsl.kernels.steps import ParamUpdate  # noqa: E402
from forge_dsl.kernels.kernel_calls import nibble_words  # noqa: E402
from forge_dsl.kernels.layouts import StateLayout  # noqa: E402
from forge_dsl.testing import as_float64_state, bound, layout_code  # noqa: E402
from tiers import sweep  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
FOUR = (StateLayout.INT4, StateLayout.UINT4)


def _dynamic_map_4bit() -> list[float]:
    """bitsandbytes' / torchao's `create_dynamic_map(signed=True, max_exponent_bits=3, total_bits=4)`, in float64."""
    data = []
    for i in range(3):
        items = 2 ** i + 1
        bounds = [0.1 + 0.9 * j / (items - 1) for j in range(items)]
        means = [(a + b) / 2 for a, b in zip(bounds[:-1], bounds[1:])]
        data += [10 ** (i - 2) * m for m in means] + [-(10 ** (i - 2)) * m for m in means]
    return sorted(data + [0.0, 1.0])


def _points(layout) -> torch.Tensor:
    if layout == StateLayout.INT4:
        return torch.tensor(_dynamic_map_4bit(), dtype=torch.float64)
    return torch.arange(1, 17, dtype=torch.float64) / 16


def _bf16_up(m: torch.Tensor) -> torch.Tensor:
    """float64 m > 0 (normal) → the smallest bf16 >= m (8 significant bits), in float64."""
    step = torch.exp2(torch.floor(torch.log2(m)) - 7)
    return torch.ceil(m / step) * step


def _nearest_decode(x: torch.Tensor, layout, scale_dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent reference: per 64-block scale = max |x| (max x, negatives as 0, for UINT4; bf16 scales: that
    rounded up to a bf16), each element decoded as fp32(scale * nearest map point) found in float64. Returns
    (decoded fp32, distance of t to the nearest midpoint) so callers can skip near-ties, where fp32
    y = x * (1 / scale) may round across."""
    x2 = L.as_rows(x.float())
    rows, cols = x2.shape
    v = x2.double() if layout == StateLayout.INT4 else x2.double().clamp_min(0)
    nb = L.n_blocks(cols)
    padded = torch.nn.functional.pad(v.abs(), (0, nb * 64 - cols)).reshape(rows, nb, 64)
    s = padded.amax(-1)
    if scale_dtype == torch.bfloat16:
        s = _bf16_up(s)
    s = s.repeat_interleave(64, dim=1)[:, :cols]
    t = v / s
    p = _points(layout)
    idx = (t[..., None] - p).abs().argmin(-1)
    mids = (p[1:] + p[:-1]) / 2
    tie = (t[..., None] - mids).abs().amin(-1)
    return (s.float() * p.float()[idx]), tie


def _signed(rows, cols, gen):
    x = torch.randn(rows, cols, generator=gen) * torch.rand(rows, 1, generator=gen).mul(3).exp()
    x[0, :64] *= 1e-3  # a block of small values beside large ones
    return x


def _nonneg(rows, cols, gen):
    return _signed(rows, cols, gen) ** 2


# ---------------------------------------------------------------------------
# torch encoding
# ---------------------------------------------------------------------------


def test_int4_map_is_torchaos_and_its_thresholds_are_midpoints():
    ref = torch.tensor(_dynamic_map_4bit(), dtype=torch.float32)
    assert torch.equal(L.INT4_MAP, ref)
    assert L.INT4_MAP[7] == 0 and L.INT4_MAP[-1] == 1 and L.INT4_MAP[0] > -1  # torchao's map has no -1
    assert (L.INT4_THRESHOLDS[1:] > L.INT4_THRESHOLDS[:-1]).all()
    mids = (L.INT4_MAP[1:].double() + L.INT4_MAP[:-1].double()) / 2
    assert ((L.INT4_THRESHOLDS.double() - mids).abs() <= mids.abs() * 2.0**-24).all()


@pytest.mark.parametrize("scale_dtype", L.SCALE_DTYPES, ids=str)
@pytest.mark.parametrize("layout", FOUR, ids=lambda l: l.name)
@pytest.mark.parametrize("shape", [(5, 200), (3, 64), (2, 3, 130), (256,)])
def test_round_trip_is_the_nearest_map_value(layout, shape, scale_dtype):
    """Every element decodes to fp32(scale × the map value nearest to x / scale), found independently in
    float64 (elements within 1e-6 of a half-way point, where fp32 rounding of x / scale decides, skipped), and
    stays within the layout's documented bound; ragged last blocks (200, 130 columns) included. bf16 scales:
    the scale is the block maximum rounded up to a bf16, and the bound grows by that factor (< 1 + 2**-7)."""
    gen = torch.Generator().manual_seed(sum(shape))
    rows, cols = L.rows_cols(shape)
    x = (_signed if layout == StateLayout.INT4 else _nonneg)(rows, cols, gen).reshape(shape)
    if layout == StateLayout.UINT4:
        x.reshape(-1)[::7] = 0.0  # true zeros: decoded as scale / 16, never 0
    q, scale = L.quantize(x, layout, scale_dtype=scale_dtype)
    assert q.dtype == (torch.int8 if layout == StateLayout.INT4 else torch.uint8)
    assert tuple(q.shape) == shape[:-1] + (shape[-1] // 2,)
    assert tuple(scale.shape) == (rows, L.n_blocks(cols)) and scale.dtype == scale_dtype
    assert L.layout_of(q, shape) == layout and L.layout_of(q, scale=scale) == layout
    d = L.dequantize(q, scale, layout)
    assert d.shape == x.shape
    want, tie = _nearest_decode(x, layout, scale_dtype)
    far = tie.reshape(shape) > 1e-6
    assert torch.equal(d[far], want.reshape(shape)[far])
    err = (d.double() - x.double()).abs()
    blockmax = torch.nn.functional.pad(L.as_rows(x).abs(), (0, L.n_blocks(cols) * 64 - cols)).reshape(
        rows, -1, 64).amax(-1).repeat_interleave(64, 1)[:, :cols].reshape(shape).double()
    if scale_dtype == torch.bfloat16:
        blockmax = blockmax * (1 + 2.0**-7)
    if layout == StateLayout.INT4:
        assert (err <= 0.1125 * blockmax * (1 + 1e-6)).all()
    else:
        assert (err <= torch.maximum(blockmax / 32, blockmax / 16 - x.double()) * (1 + 1e-6)).all()
        assert (d > 0).all()  # the zero-point rule: nothing in a block with a positive scale decodes to 0
    assert (err <= bound(layout, x.double(), d, scale)).all()


def test_nibble_order_and_storage():
    """Element 2j in the low nibble of byte j, 2j + 1 in the high one; INT4 0 is code 7, 1.0 code 15."""
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1], x[0, 2], x[0, 3] = 1.0, 0.0, -0.0055, 0.2125
    q, s = L.quantize(x, StateLayout.INT4)
    b = q.view(torch.uint8)[0]
    assert b[0] == 15 | (7 << 4) and b[1] == 6 | (11 << 4) and (b[2:] == 7 | (7 << 4)).all()
    assert s.item() == 1.0
    v = torch.zeros(1, 64)
    v[0, 0], v[0, 1] = 1.0, 0.5
    q, s = L.quantize(v, StateLayout.UINT4)
    assert q[0, 0] == 15 | (7 << 4) and (q[0, 1:] == 0).all()  # 0.5 = 8/16: code 7; zeros: code 0 (1/16)


@pytest.mark.parametrize("scale_dtype", L.SCALE_DTYPES, ids=str)
@pytest.mark.parametrize("layout", FOUR, ids=lambda l: l.name)
def test_special_blocks(layout, scale_dtype):
    """NaN or inf in a block: its scale is NaN and the whole block reads NaN; an all-zero block reads 0; a scale
    whose reciprocal overflows stores the zero code (INT4: 0; UINT4: scale / 16); UINT4 stores negatives as 0."""
    x = torch.rand(4, 256) + 0.5
    x[0, 3] = math.nan
    x[1, 70] = -math.inf if layout == StateLayout.INT4 else math.inf
    x[2, 128:192] = 0.0
    x[3, 192:256] = 1e-39 if layout == StateLayout.INT4 else 1e-38
    if layout == StateLayout.UINT4:
        x[3, 0] = -5.0
    q, s = L.quantize(x, layout, scale_dtype=scale_dtype)
    assert s.dtype == scale_dtype
    d = L.dequantize(q, s, layout)
    s = s.float()  # exact, NaN 0x7FC0 → 0x7FC00000
    assert torch.isnan(s[0, 0]) and torch.isnan(s[1, 1]) and s[0, 0].view(torch.int32) == 0x7FC00000
    assert torch.isnan(d[0, :64]).all() and torch.isnan(d[1, 64:128]).all()
    assert torch.isfinite(d[0, 64:]).all() and torch.isfinite(d[1, :64]).all()
    assert s[2, 2] == 0 and (d[2, 128:192] == 0).all()
    tiny = d[3, 192:256]
    if layout == StateLayout.INT4:
        assert (tiny == 0).all()
    else:
        assert (tiny == s[3, 3] * 0.0625).all() and (tiny > 0).all()
        assert d[3, 0] == s[3, 0] * 0.0625  # -5 stored as 0, read as the smallest value


def test_new_state_has_bf16_scales_half_the_bytes():
    """`init_state` gives int8 and int4 state bf16 block scales (`layouts.SCALE_DTYPE`): half the bytes of float32
    ones, 2 bytes per 64 elements beside each state's codes; `quantize` makes either on request, `dequantize`
    reads either, and any other dtype is refused naming both."""
    w = torch.randn(96, 640)
    for layout in ("int8", "int4"):
        state = forge_dsl.init_state("adamw", w, layout=layout)
        for name in ("exp_avg", "exp_avg_sq"):
            scale = state[f"{name}.scale"]
            assert scale.dtype == torch.bfloat16 == L.SCALE_DTYPE and tuple(scale.shape) == (96, 10)
            t = state[name]
            lay = L.layout_of(t, w.shape)
            _, fp32 = L.quantize(torch.zeros(96, 640), lay, scale_dtype=torch.float32)
            assert scale.nbytes * 2 == fp32.nbytes == 96 * 640 // 64 * 4
            assert scale.nbytes / t.nbytes == (2 / 64 if layout == "int8" else 4 / 64)  # 3.125 %, int4 6.25 %
    x = torch.randn(3, 128)
    with pytest.raises(TypeError, match=r"scale_dtype must be torch.float32 or torch.bfloat16 \(block scales\), "
                                        r"got torch.float16"):
        L.quantize(x, StateLayout.INT8, scale_dtype=torch.float16)
    q, scale = L.quantize(x, StateLayout.INT4)
    with pytest.raises(TypeError, match=r"INT4 block scale dtype must be torch.float32 or torch.bfloat16"):
        L.dequantize(q, scale.half(), StateLayout.INT4)
    # a bf16 scale is the block maximum rounded up: the decoded values follow it, within the same bound relative
    # to the stored scale (larger than with float32 scales by less than 1 + 2**-7)
    q8, s8 = L.quantize(x, StateLayout.INT8)
    q8f, s8f = L.quantize(x, StateLayout.INT8, scale_dtype=torch.float32)
    ratio = s8.double() / s8f.double()
    assert (ratio >= 1).all() and (ratio < 1 + 2.0**-7).all()
    err = (L.dequantize(q8, s8, StateLayout.INT8).double() - x.double()).abs()
    assert (err <= s8.double().repeat_interleave(64, 1) / 254 * (1 + 1e-6)).all()


def test_resolve_layout_and_layout_of():
    R = L.resolve_layout
    assert R("int4", False, (10, 128)) == StateLayout.INT4 and R("int4", True, (10, 128)) == StateLayout.UINT4
    assert R("int4", False, (10, 63)) == StateLayout.FP32  # below a block
    assert R("int4", True, (10, 129)) == StateLayout.FP32  # odd last dim: two codes would straddle rows
    assert R("int4", False, (130,)) == StateLayout.INT4
    assert L.storage_shape(StateLayout.INT4, (3, 5, 128)) == (3, 5, 64)
    assert L.storage_shape(StateLayout.INT8, (3, 5, 128)) == (3, 5, 128)
    codes = torch.zeros(10, 64, dtype=torch.int8)
    assert L.layout_of(codes, (10, 128)) == StateLayout.INT4 and L.layout_of(codes, (10, 64)) == StateLayout.INT8
    assert L.layout_of(codes.view(torch.uint8), (10, 128)) == StateLayout.UINT4
    assert L.layout_of(torch.zeros(10, 64, dtype=torch.int8), (10, 129)) == StateLayout.INT8  # never int4
    assert L.layout_of(codes, scale=torch.zeros(10, 2)) == StateLayout.INT4
    assert L.layout_of(codes, scale=torch.zeros(10, 1)) == StateLayout.INT8
    assert L.layout_of(torch.zeros(3, dtype=torch.int16), (3,)) is None
    assert L.is_quantized(StateLayout.INT4) and L.holds_codes(codes)
    with pytest.raises(ValueError, match="unknown state layout 'int2'.*'int4'"):
        R("int2", False, (10, 128))
    with pytest.raises(ValueError, match="needs an even last dim"):
        L.quantize(torch.ones(2, 129), StateLayout.INT4)


# ---------------------------------------------------------------------------
# Triton helpers against the torch encoding, bit for bit
# ---------------------------------------------------------------------------


@triton.jit
def _store_kernel(src, q, scale, n_rows, n_cols, n_blocks, LAYOUT: tl.constexpr, WORDS: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(1) * BLOCK_K
    offs, mask = tile_lib.tile_offsets(offs_n, k_start + tl.arange(0, BLOCK_K), n_rows, n_cols)
    scale_offs = state_lib.block_scale_offsets(offs_n, k_start, n_blocks, BLOCK_K)
    x = tl.load(src + offs, mask=mask, other=0.0)
    state_lib.store_state(q, scale, x, offs, mask, scale_offs, LAYOUT, WORDS, BLOCK_N, BLOCK_K)


@triton.jit
def _update_kernel(q, scale, out, n_rows, n_cols, n_blocks, mult, LAYOUT: tl.constexpr, WORDS: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out = the decoded tile; then the state becomes decoded * mult (in place: an optimizer step's shape)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(1) * BLOCK_K
    offs, mask = tile_lib.tile_offsets(offs_n, k_start + tl.arange(0, BLOCK_K), n_rows, n_cols)
    scale_offs = state_lib.block_scale_offsets(offs_n, k_start, n_blocks, BLOCK_K)
    x = state_lib.load_state(q, scale, offs, mask, scale_offs, LAYOUT, WORDS, BLOCK_N, BLOCK_K)
    tl.store(out + offs, x, mask=mask)
    state_lib.store_state(q, scale, x * mult, offs, mask, scale_offs, LAYOUT, WORDS, BLOCK_N, BLOCK_K)


@triton.jit
def _code_kernel(y, q, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(q + offs, state_lib._int4_code(tl.load(y + offs)))


@triton.jit
def _value_kernel(q, v, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(v + offs, state_lib._int4_value(tl.load(q + offs)))


PAD = 64  # sentinel bytes / scales past the real tensors: catch out-of-bounds stores


def _scale_arg(t):
    """Block scales as the kernels take them: float32, or bf16 as its int16 view."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _scale_bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def _run_store(x, layout, block, scale_dtype=torch.float32, words=False):
    rows, cols = x.shape
    nb = L.n_blocks(cols)
    qbuf = torch.full((rows * cols // 2 + PAD,), 0x55, dtype=L.storage_dtype(layout), device=DEVICE)
    sbuf = torch.full((rows * nb + PAD,), -7.0, dtype=scale_dtype, device=DEVICE)
    bn, bk = block
    _store_kernel[(triton.cdiv(rows, bn), triton.cdiv(cols, bk))](
        x.to(DEVICE).contiguous(), qbuf, _scale_arg(sbuf), rows, cols, nb, LAYOUT=int(layout), WORDS=words,
        BLOCK_N=bn, BLOCK_K=bk)
    qbuf, sbuf = qbuf.cpu(), sbuf.cpu()
    assert (qbuf[rows * cols // 2:] == 0x55).all() and (sbuf[rows * nb:] == -7.0).all(), "stored past the end"
    return qbuf[: rows * cols // 2].reshape(rows, cols // 2), sbuf[: rows * nb].reshape(rows, nb)


def _edge_values(layout) -> torch.Tensor:
    """Rows whose blocks have scale 1 and elements on, just below and just above every threshold (x / scale is
    then x itself, INT4; 16 x, UINT4), and rows of special values."""
    if layout == StateLayout.INT4:
        th = L.INT4_THRESHOLDS
    else:
        th = (torch.arange(1, 16, dtype=torch.float32) + 0.5) / 16
    vals = torch.cat([th, torch.nextafter(th, torch.full_like(th, -2)), torch.nextafter(th, torch.full_like(th, 2))])
    row = torch.cat([torch.ones(1), vals, torch.zeros(128 - 1 - vals.numel())])
    rows = [row, row.flip(0)]
    special = torch.rand(128) + 0.25
    special[5], special[70] = math.nan, math.inf
    rows.append(special)
    tiny = torch.full((128,), 1e-39 if layout == StateLayout.INT4 else 1e-38)
    tiny[64:] = torch.linspace(0, 3e-38, 64)
    rows.append(tiny)
    big = torch.full((128,), -0.0)  # a -0 block, and one whose maximum is above the largest finite bf16
    big[64:] = torch.linspace(-3.0e38, 3.0e38, 64, dtype=torch.float64).float()
    big[64 + 17] = torch.finfo(torch.float32).max
    rows.append(big)
    return torch.stack(rows)


# (shape, tile, NIBBLE_WORDS): a word of 8 codes at a time where the columns are a multiple of 8, else a byte
STORE_CASES = [((19, 200), (8, 128), True), ((19, 200), (8, 128), False), ((5, 128), (4, 64), True),
               ((6, 136), (2, 256), True), ((7, 130), (4, 128), False), ((3, 202), (2, 256), False)]


@pytest.mark.parametrize("scale_dtype", L.SCALE_DTYPES, ids=str)
@pytest.mark.parametrize("layout", FOUR, ids=lambda l: l.name)
@pytest.mark.parametrize("shape,block,words", STORE_CASES,
                         ids=lambda c: "words" if c is True else ("bytes" if c is False else None))
def test_store_state_matches_quantize_bit_for_bit(layout, shape, block, words, scale_dtype):
    """`store_state` writes the bytes and scales `layouts.quantize` computes, a 32-bit word of 8 codes or a byte of
    2 at a time (NIBBLE_WORDS): random rows (ragged last blocks and tiles, rows past the tensor masked), threshold
    edges, NaN / inf / -0 / tiny-scale blocks; nothing written past the tensors."""
    gen = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    rows, cols = shape
    x = (_signed if layout == StateLayout.INT4 else _nonneg)(rows, cols, gen)
    if layout == StateLayout.UINT4:
        x[1, :cols:3] = -x[1, :cols:3]  # negatives: stored as 0
    edges = _edge_values(layout)
    if cols >= 128:
        n = min(rows, edges.shape[0])
        x[-n:, :128] = edges[-n:]
    q, s = _run_store(x, layout, block, scale_dtype, words)
    ref_q, ref_s = L.quantize(x, layout, scale_dtype=scale_dtype)
    assert s.dtype == ref_s.dtype == scale_dtype
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(_scale_bits(s), _scale_bits(ref_s))
    if scale_dtype == torch.bfloat16 and cols >= 128:  # the maximum above the largest bf16 saturates to it
        assert _scale_bits(s)[-1, 1] == 0x7F7F


@pytest.mark.parametrize("scale_dtype", L.SCALE_DTYPES, ids=str)
@pytest.mark.parametrize("layout", FOUR, ids=lambda l: l.name)
@pytest.mark.parametrize("cols,words", [(200, True), (200, False), (202, False)], ids=["200-words", "200-bytes",
                                                                                       "202-bytes"])
def test_load_and_update_match_torch_bit_for_bit(layout, cols, words, scale_dtype):
    """`load_state` decodes what `dequantize` does (NaN blocks as NaN), and a load → × 0.75 → store in place
    writes `quantize(dequantize(...) * 0.75)`: by words of 8 codes and by bytes of 2 (NIBBLE_WORDS)."""
    gen = torch.Generator().manual_seed(3)
    rows = 11
    x = (_signed if layout == StateLayout.INT4 else _nonneg)(rows, cols, gen)
    x[-5:, :128] = _edge_values(layout)
    q, s = L.quantize(x, layout, scale_dtype=scale_dtype)
    qd, sd = q.to(DEVICE).clone(), s.to(DEVICE).clone()
    out = torch.full((rows, cols), 777.0, device=DEVICE)
    bn, bk = 8, 128
    _update_kernel[(triton.cdiv(rows, bn), triton.cdiv(cols, bk))](
        qd, _scale_arg(sd), out, rows, cols, L.n_blocks(cols), 0.75, LAYOUT=int(layout), WORDS=words, BLOCK_N=bn,
        BLOCK_K=bk)
    want = L.dequantize(q, s, layout)
    got = out.cpu()
    nan = torch.isnan(want)
    assert nan.any() and torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))
    ref_q, ref_s = L.quantize(want * 0.75, layout, scale_dtype=scale_dtype)
    assert torch.equal(qd.cpu().view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(_scale_bits(sd.cpu()), _scale_bits(ref_s))


def _as_f32(bits: torch.Tensor) -> torch.Tensor:
    """int64 bit patterns in [0, 2**32) → fp32."""
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def test_int4_code_and_value_are_the_comparisons_and_the_map():
    """`_int4_code` (a binary search on the magnitude's bits) counts what the 15 comparisons `y >= mu_k` count, for
    every threshold and the 4 fp32 values on either side of it (both signs), ±0, ±inf, NaNs, ±1 and its
    neighbours, denormals, and every 4099th fp32 bit pattern; `_int4_value` (a tree of selects on |q - 7|, the
    sign ORed in) is `INT4_MAP` bit for bit, from uint8 and int32 codes. Both rest on the symmetries checked."""
    th, mp = L.INT4_THRESHOLDS, L.INT4_MAP
    assert torch.equal(th[:7].view(torch.int32), (-th[7:14].flip(0)).view(torch.int32))
    assert torch.equal(mp[:7].view(torch.int32), (-mp[8:15].flip(0)).view(torch.int32)) and mp[15] == 1.0
    edges = torch.cat([th, mp, torch.ones(1)]).view(torch.int32).to(torch.int64) & 0x7FFFFFFF
    edges = (edges[:, None] + torch.arange(-4, 5)).reshape(-1)
    special = torch.tensor([0, 1, 0x7FFFFF, 0x7F7FFFFF, 0x7F800000, 0x7F800001, 0x7FC00000, 0x7FFFFFFF])
    bits = torch.cat([edges, special, torch.arange(0, 2**32, 4099)])
    bits = torch.cat([bits, bits[: 2 * len(edges) + 2 * len(special)] ^ 0x80000000])  # the negatives
    block = 2**16 if INTERPRET else 1024
    y = _as_f32(torch.cat([bits, torch.zeros(-len(bits) % block, dtype=torch.int64)]))
    q = torch.empty(len(y), dtype=torch.int32, device=DEVICE)
    _code_kernel[(len(y) // block,)](y.to(DEVICE), q, BLOCK=block)
    want = (y[:, None] >= th[None, :]).sum(1).to(torch.int32)
    bad = (q.cpu() != want).nonzero()[:5, 0]
    assert not len(bad), [(y[i].item(), q[i].item(), want[i].item()) for i in bad]
    for dtype in (torch.uint8, torch.int32):
        v = torch.empty(16, device=DEVICE)
        _value_kernel[(1,)](torch.arange(16, dtype=dtype, device=DEVICE), v, BLOCK=16)
        assert torch.equal(v.cpu().view(torch.int32), mp.view(torch.int32))


def test_nibble_words_decides_by_columns_alignment_size_and_layout(probe, monkeypatch):
    """`kernel_calls.nibble_words`: 4-bit state in words where the rows have a multiple of 8 columns and the storage
    starts on a 4-byte boundary, row blocks (`StateArgs.rows`) at any first row included, and is small enough for
    int32 word offsets; bytes otherwise; False without 4-bit state (int8), so that those launches compile one
    kernel whatever the columns."""
    for cols, words in ((200, True), (128, True), (202, False), (130, False)):
        w = torch.zeros(9, cols, device=DEVICE)
        states = bind_states(probe, ("m", "v"), forge_dsl.init_state(probe, w, layout="int4"), w)
        assert nibble_words(cols, states) is words
        assert all(nibble_words(cols, states.rows(r0, 9)) is words for r0 in range(9))
    w = torch.zeros(9, 200, device=DEVICE)
    state = forge_dsl.init_state(probe, w, layout="int4")
    assert not nibble_words(200, bind_states(probe, ("m", "v"), forge_dsl.init_state(probe, w, layout="int8"), w))
    for offset in (1, 2, 3):  # a contiguous view that starts off a word
        buf = torch.zeros(state["m"].numel() + 4, dtype=torch.int8, device=DEVICE)
        moved = {**state, "m": buf[offset:offset + state["m"].numel()].view(state["m"].shape)}
        assert not nibble_words(200, bind_states(probe, ("m", "v"), moved, w))
    states = bind_states(probe, ("m", "v"), state, w)
    monkeypatch.setattr(kernel_calls, "NIBBLE_WORDS_MAX_BYTES", state["m"].numel())  # as if 8 GiB of codes
    assert not nibble_words(200, states) and nibble_words(200, states.rows(1, 9))


@pytest.mark.parametrize("cols", [200, 202], ids=["words", "bytes"])
def test_row_blocks_and_unaligned_state_step_as_the_whole_does(probe, cols):
    """Row blocks (`ParamUpdate.from_grad(rows=...)`: each block's state a view starting cols / 2 bytes per row in,
    a word boundary for cols % 8 == 0) and state stored at an odd address (the byte path, `kernel_calls.nibble_words`)
    write the bits one element-wise launch on the whole aligned parameter does (nearest rounding)."""
    gen = torch.Generator().manual_seed(cols)
    w = torch.randn(9, cols, generator=gen).to(DEVICE)
    state = forge_dsl.init_state(probe, w, layout="int4")
    for k in ("m", "v"):
        state[k], state[f"{k}.scale"] = (t.to(DEVICE) for t in L.quantize(torch.randn(9, cols, generator=gen).abs(),
                                                                         L.layout_of(state[k], w.shape)))
    g = torch.randn(9, cols, generator=gen).to(DEVICE)
    want_w, want = w.clone(), {k: v.clone() for k, v in state.items()}
    kernels.step(probe, want_w, g, want, step=1, rounding="nearest")
    blocks_w, blocks = w.clone(), {k: v.clone() for k, v in state.items()}
    update = ParamUpdate(probe, blocks_w, blocks, step=1, rounding="nearest")
    for r0, r1 in ((0, 3), (3, 4), (4, 9)):
        update.from_grad(g[r0:r1], rows=r0)
    update.commit()
    moved_w, moved = w.clone(), {k: v.clone() for k, v in state.items()}
    for k in ("m", "v"):
        buf = torch.zeros(moved[k].numel() + 4, dtype=moved[k].dtype, device=DEVICE)
        moved[k] = buf[1:1 + moved[k].numel()].view(moved[k].shape)
        moved[k].copy_(state[k])
    kernels.step(probe, moved_w, g, moved, step=1, rounding="nearest")
    for got_w, got in ((blocks_w, blocks), (moved_w, moved)):
        assert torch.equal(got_w, want_w)
        _assert_state_bits(got, {k: v.cpu() for k, v in want.items()})


# ---------------------------------------------------------------------------
# the kernels' steps
# ---------------------------------------------------------------------------

# The new state is the gradient (m) and its square (v), the weight moves by the decoded old states: every
# value the kernel computes is one fp32 operation of loaded values, so torch reproduces it bit for bit (the
# weight up to FMA contraction when compiled: see the tests' docstrings).
_PROBE = """optimizer int4_probe "int4 state: what the kernel stores and reads"

state m = 0
state v = 0 nonneg

update {
    param = param + m - v
    m = grad
    v = grad * grad
}
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    path = tmp_path_factory.mktemp("int4") / "int4_probe.fopt"
    path.write_text(_PROBE)
    return forge_dsl.load_spec(str(path))


def _torch_probe_step(w, g, state):
    """The probe's step in fp32 torch from the stored quantized state (int4, or int8: its layouts and its scales'
    dtype as stored): new weight and the expected storage."""
    lm, lv = (L.layout_of(state[k], scale=state[f"{k}.scale"]) for k in ("m", "v"))
    m = L.dequantize(state["m"], state["m.scale"], lm)
    v = L.dequantize(state["v"], state["v.scale"], lv)
    w_new = (w.float() + m) - v
    qm, sm = L.quantize(g.float(), lm, scale_dtype=state["m.scale"].dtype)  # the scales' format stays
    qv, sv = L.quantize(g.float() * g.float(), lv, scale_dtype=state["v.scale"].dtype)
    return w_new, {"m": qm, "m.scale": sm, "v": qv, "v.scale": sv}, w.float().abs() + m.abs() + v.abs()


def _assert_weight_bits(w, want, what, operands):
    """w (the kernel's fp32 weight, any device) against `want` (fp32, CPU): the same bits in the interpreter; run
    compiled, within two fp32 roundings of the operands' size `operands` (|w| + |m| + |v|, the probe's sum):
    fp fusion may contract a decode's multiply with the spec's add into one FMA, which rounds the partial sum
    w + m at another place, and where w + m - v cancels that is many ulps of the result (measured on the H200:
    up to 56 of 1800 elements beyond 1 ulp)."""
    got = w.cpu()
    if INTERPRET:
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), what
        return
    excess = (got.double() - want.double()).abs() - 2.0**-22 * operands.double()
    assert (excess <= 0).all(), f"{what}: {(excess > 0).sum().item()} weights beyond two roundings of their operands"


def _assert_state_bits(state, want):
    for k, t in want.items():
        a, b = state[k].cpu(), t
        assert a.shape == b.shape and a.dtype == b.dtype, k
        assert torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a.view(torch.int32),
                           b.view(torch.uint8) if b.dtype != torch.float32 else b.view(torch.int32)), k


# (130,): int4 codes a byte at a time (130 % 8 != 0, `kernel_calls.nibble_words`); the others a 32-bit word
@pytest.mark.parametrize("layout", ["int4", "int8"])
@pytest.mark.parametrize("shape,scale_dtype", [((9, 200), torch.bfloat16), ((130,), torch.bfloat16),
                                               ((2, 3, 128), torch.bfloat16), ((9, 200), torch.float32)])
def test_elementwise_step_with_int4_state_is_bit_exact(probe, shape, scale_dtype, layout):
    """The stored int4 state is `quantize` of the new gradient and its square, bit for bit, and the weight moves by
    the decoded old states. The weight is bit-exact in the interpreter; compiled, the kernel is built with fp
    fusion, so the decode's multiply and the spec's add may contract into one FMA (one rounding instead of two):
    there the weight is within 1 fp32 ulp of torch's, while the stored state's bits must still match exactly."""
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(shape, generator=gen).to(DEVICE)
    state = forge_dsl.init_state(probe, w, layout=layout)
    four = StateLayout.INT4 if layout == "int4" else StateLayout.INT8
    assert state["m"].shape == L.storage_shape(four, shape) and state["v"].dtype == torch.uint8
    assert state["m.scale"].dtype == state["v.scale"].dtype == torch.bfloat16  # new state: bf16 scales
    _with_scales(state, scale_dtype)
    for step in (1, 2, 3):
        g = (torch.randn(shape, generator=gen) * (1 + step)).to(DEVICE)
        w_new, want, operands = _torch_probe_step(w.cpu(), g.cpu(), {k: v.cpu() for k, v in state.items()})
        kernels.step(probe, w, g, state, step=step, rounding="nearest")
        _assert_state_bits(state, want)
        _assert_weight_bits(w, w_new, f"step {step}", operands)


# the quick tier: int4 state (int8 state's fused kernel is in tests/kernels/test_kernels.py's quick cases too)
@pytest.mark.parametrize(*sweep(("config,scale_dtype,k", [(None, torch.bfloat16, 200), ("halves", torch.bfloat16, 200),
                                                          (None, torch.float32, 200), (None, torch.bfloat16, 202)],
                                 ["None-scale_dtype0-200", "halves-scale_dtype1-200", "None-scale_dtype2-200",
                                  "None-scale_dtype3-202"]),
                                ("layout", ["int4", "int8"]),
                                quick=["None-scale_dtype0-200-int4", "halves-scale_dtype1-200-int4",
                                       "None-scale_dtype2-200-int4", "None-scale_dtype3-202-int4"]))
def test_fused_step_with_int4_state_is_bit_exact(probe, config, scale_dtype, k, layout):
    """The fused kernel (dW in its registers) stores the int4 state of its own dW: the stored bytes are
    `quantize` of that dW (read back from m's twin, an fp32 copy of the same spec), bit for bit, and the weight
    moves by the decoded old states: bit-exact in the interpreter; compiled with fp fusion, where the decode's
    multiply and the spec's add may contract into one FMA, within 1 fp32 ulp of torch's. 200 columns: int4 codes
    a 32-bit word at a time; 202: a byte (`kernel_calls.nibble_words`)."""
    from forge_dsl.testing import HALVES_CONFIG

    cfg = HALVES_CONFIG if config == "halves" else None
    gen = torch.Generator().manual_seed(5)
    n, t = 72, 40
    w = torch.randn(n, k, generator=gen).to(DEVICE)
    w_fp32 = w.clone()
    state = forge_dsl.init_state(probe, w, layout=layout)
    _with_scales(state, scale_dtype)
    twin = forge_dsl.init_state(probe, w_fp32, layout="fp32")
    for step in (1, 2):
        x = torch.randn(t, k, generator=gen).to(DEVICE)
        dy = (torch.randn(t, n, generator=gen) * 0.1).to(DEVICE)
        kernels.fused_linear_step(probe, x, dy, w_fp32, twin, step=step, config=cfg)  # twin["m"]: the kernel's dW
        w_new, want, operands = _torch_probe_step(w.cpu(), twin["m"].cpu(),
                                                  {kk: vv.cpu() for kk, vv in state.items()})
        kernels.fused_linear_step(probe, x, dy, w, state, step=step, config=cfg)
        _assert_state_bits(state, want)
        _assert_weight_bits(w, w_new, f"step {step}", operands)
        w_fp32.copy_(w)  # both start the next step from the same weights


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "step"])
@pytest.mark.parametrize("name", ["adamw", "lion", "rmsprop"])
def test_builtin_specs_with_int4_state_within_the_bound(name, fused):
    """Three steps from the kernel's own dequantized state, each state within `bound` of the float64 reference."""
    from forge_dsl.testing import make_problem

    spec = forge_dsl.load_spec(name)
    kw = {"lr": 1e-3 if name == "lion" else 1e-2}
    w, x, dy = make_problem(3, torch.float32)
    state = forge_dsl.init_state(spec, w, layout="int4", **kw)
    assert any(layout_code(state[s.name], state.get(f"{s.name}.scale")) in FOUR for s in spec.states)
    for step in range(1, 4):
        ref_w, ref_state = w.double().cpu(), as_float64_state(state, spec)
        dw = dy.double().cpu().T @ x.double().cpu()
        forge_dsl.reference_step(spec, ref_w, dw, ref_state, step=step, **kw)
        if fused:
            kernels.fused_linear_step(spec, x, dy, w, state, step=step, **kw)
        else:
            kernels.step(spec, w, dw.float().to(DEVICE), state, step=step, **kw)
        got_state = as_float64_state(state, spec)
        for s in spec.states:
            if s.name not in state:
                continue
            scale = state.get(f"{s.name}.scale")
            lay = layout_code(state[s.name], scale)
            tol = bound(lay, ref_state[s.name], got_state[s.name], scale)
            excess = ((got_state[s.name] - ref_state[s.name]).abs() - tol).max().item()
            assert excess <= 0, f"step {step}: {s.name} ({lay.name}) off by {excess:.3e} beyond its bound"


def test_foreach_step_with_int4_state_matches_separate_steps(probe):
    """Parameters with int4 state share one flat launch (last dims multiples of 64): the same bits as one
    launch each; int8 and int4 states (both int8 storage) never share a key."""
    from forge_dsl.kernels.foreach import foreach_step, shared_launch_key

    gen = torch.Generator().manual_seed(2)
    params = [torch.randn(s, generator=gen).to(DEVICE) for s in ((3, 128), (64,), (2, 2, 192))]
    grads = [torch.randn(p.shape, generator=gen).to(DEVICE) for p in params]
    states = [forge_dsl.init_state(probe, p, layout="int4") for p in params]
    solo = [p.clone() for p in params]
    solo_states = [{k: v.clone() for k, v in s.items()} for s in states]
    keys = {shared_launch_key(probe, p, g, s) for p, g, s in zip(params, grads, states)}
    assert len(keys) == 1 and None not in keys
    int8 = forge_dsl.init_state(probe, params[0], layout="int8")
    assert shared_launch_key(probe, params[0], grads[0], int8) not in keys
    foreach_step(probe, params, grads, states, step=1, rounding="nearest")
    for p, g, s in zip(solo, grads, solo_states):
        kernels.step(probe, p, g, s, step=1, rounding="nearest")
    for a, b, sa, sb in zip(params, solo, states, solo_states):
        assert torch.equal(a, b)
        _assert_state_bits(sa, {k: v.cpu() for k, v in sb.items()})


_SM90_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
# The compiler needs real @triton.jit functions: compile in a process without the interpreter.
_SM90_SCRIPT = """
import json, sys
from dataclasses import asdict
from forge_dsl.kernels.policy import TileConfig
from forge_dsl.bench.sm90 import compile_fused
print(json.dumps([asdict(compile_fused("adamw", "int4", TileConfig.parse(c) if c else None, 2048, "bf16", cols))
                  for c, cols in json.loads(sys.argv[1])]))
"""


@pytest.mark.slow  # compiles for sm_90: about 10 s
@pytest.mark.skipif(not os.path.exists(_SM90_BIN), reason="this Triton has no bundled NVIDIA tools")
def test_int4_state_is_accessed_in_words_on_sm90():
    """AdamW's fused kernel with int4 state compiled for sm_90 (`forge_dsl.bench.sm90`, no GPU needed) reads and
    writes the codes a 32-bit word (8 codes) at a time, not a byte, for K = 4096: the default kernel (the
    warp-specialized one where this Triton has Gluon, whose epilogue then no longer spills beyond the 96 B
    allowed under a register cap in tests/kernels/test_sm90.py: it spilled 192-224 B with byte access) and the Triton
    kernel's int8-state tiles; K = 4100 (K % 8 != 0) keeps the bytes."""
    cases = [(None, 4096), ("64,128,64,8,4,0,1,maxnreg=128", 4096), ("64,128,64,8,4,0,0,maxnreg=128", 4100)]
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    out = subprocess.run([sys.executable, "-c", _SM90_SCRIPT, json.dumps(cases)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    default, tiles, odd = json.loads(out.stdout.strip().splitlines()[-1])
    for res in (default, tiles):
        ops = res["memory_ops"]
        assert ops.get("ld.global.b32", 0) > 0 and ops.get("st.global.b32", 0) > 0, res
        assert not any(".b8" in op for op in ops), res
    assert default["stack_bytes"] <= 96, default
    assert odd["memory_ops"].get("ld.global.b8", 0) > 0 and odd["memory_ops"].get("st.global.b8", 0) > 0, odd


# ---------------------------------------------------------------------------
# ForgeOptimizer, state dicts, describe
# ---------------------------------------------------------------------------


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 16)).to(DEVICE)


def _train(model, opt, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(24, 64, generator=gen).to(DEVICE)
        y = torch.randn(24, 16, generator=gen).to(DEVICE)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _adamw_int4_torch(model, steps, lr, weight_decay, betas=(0.9, 0.999), eps=1e-8, seed=1):
    """torch.optim.AdamW's update in plain fp32 torch, its m and v held between steps as `layouts.quantize`
    stores them under state_dtype="int4" (each step decodes them, updates from the new fp32 values, encodes)."""
    b1, b2 = betas
    held = {}
    gen = torch.Generator().manual_seed(seed)
    for t in range(1, steps + 1):
        x = torch.randn(24, 64, generator=gen).to(DEVICE)
        y = torch.randn(24, 16, generator=gen).to(DEVICE)
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                lm, lv = (L.resolve_layout("int4", nonneg, p.shape) for nonneg in (False, True))
                if p not in held:
                    held[p] = (L.quantize(torch.zeros_like(p), lm), L.quantize(torch.zeros_like(p), lv))
                (qm, sm), (qv, sv) = held[p]
                m = b1 * L.dequantize(qm, sm, lm) + (1 - b1) * p.grad
                v = b2 * L.dequantize(qv, sv, lv) + (1 - b2) * p.grad * p.grad
                p.mul_(1 - lr * weight_decay)
                p.sub_(lr / (1 - b1 ** t) * m / (v.sqrt() / (1 - b2 ** t) ** 0.5 + eps))
                held[p] = (L.quantize(m, lm), L.quantize(v, lv))


def test_optimizer_int4_state_against_torch():
    """ForgeOptimizer(state_dtype="int4") on a small MLP (weights [128, 64] and [16, 128], a [128] bias with int4
    state, a [16] bias with fp32 state): 10 steps within 1e-4 of the movement of AdamW written in torch with the
    same int4-rounded states (`_adamw_int4_torch`); and within 25 % of torch.optim.AdamW's, what 4-bit m and v
    cost here (16 % after 5 steps, 19 % after 10; int8: 1 %): v rounded up to its block's scale / 16 shrinks
    small elements' updates."""
    ours, twin, theirs = _model(), _model(), _model()
    forge_dsl.fuse(ours)
    opt = ForgeOptimizer(ours, "adamw", lr=1e-2, weight_decay=0.01, state_dtype="int4", rounding="nearest")
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.01)
    start = [p.detach().clone() for p in theirs.parameters()]
    _train(ours, opt, 10)
    _adamw_int4_torch(twin, 10, lr=1e-2, weight_decay=0.01)
    _train(theirs, ref, 10)
    w = ours[0].weight
    assert opt.state[w]["exp_avg"].shape == (128, 32) and opt.state[w]["exp_avg_sq"].dtype == torch.uint8
    assert opt.state[ours[0].bias]["exp_avg"].shape == (64,)
    assert opt.state[ours[2].bias]["exp_avg"].dtype == torch.float32  # [16]: below one block
    for a, b, c, s in zip(ours.parameters(), twin.parameters(), theirs.parameters(), start):
        assert (a - b).norm() <= 1e-4 * (b - s).norm(), (a - b).norm() / (b - s).norm()
        assert (a - c).norm() <= 0.25 * (c - s).norm(), (a - c).norm() / (c - s).norm()
    assert "state int4" in opt.describe()


def _with_scales(state: dict, scale_dtype) -> None:
    """Re-store every quantized state of `state` (in place) with block scales of `scale_dtype`, as a checkpoint
    written before bf16 scales holds them (float32)."""
    for name in [k for k in state if f"{k}.scale" in state]:
        t, scale = state[name], state[f"{name}.scale"]
        layout = L.layout_of(t, scale=scale)
        state[name], state[f"{name}.scale"] = L.quantize(L.dequantize(t, scale, layout), layout,
                                                         scale_dtype=scale_dtype)


@pytest.mark.parametrize("scale_dtype", L.SCALE_DTYPES, ids=str)
def test_state_dict_round_trip_and_describe(tmp_path, scale_dtype):
    """An int4 checkpoint loads bit for bit and continues as the optimizer that saved it would; with float32
    scales (every checkpoint before bf16 ones) too, which stay float32 as it steps."""
    model = _model(3)
    forge_dsl.fuse(model)
    opt = ForgeOptimizer(model, "adamw", lr=1e-2, state_dtype="int4", rounding="nearest", seed=4)
    _train(model, opt, 2)
    for state in opt.state.values():
        _with_scales(state, scale_dtype)
    path = tmp_path / "opt.pt"
    torch.save(opt.state_dict(), path)
    sd = torch.load(path, weights_only=True)
    model2 = _model(3)
    model2.load_state_dict(model.state_dict())
    forge_dsl.fuse(model2)
    opt2 = ForgeOptimizer(model2, "adamw", lr=1e-2, state_dtype="fp32", rounding="nearest", seed=4)
    opt2.load_state_dict(sd)
    assert opt2.state_dtype == "int4"
    for p, p2 in zip(model.parameters(), model2.parameters()):
        _assert_state_bits(opt2.state[p2], {k: v.cpu() for k, v in opt.state[p].items() if k.startswith("exp")})
    text = opt2.describe()
    words = "fp32" if scale_dtype == torch.float32 else "bf16"
    assert (f"state held: exp_avg int4 ({words} scales) ×3, fp32 ×1; exp_avg_sq uint4 (no-zero map, {words} scales) "
            "×3, fp32 ×1") in text, text
    _train(model, opt, 1, seed=9)
    _train(model2, opt2, 1, seed=9)
    for p, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, p2)
        for k, v in opt.state[p].items():
            if k.endswith(".scale"):
                assert v.dtype == opt2.state[p2][k].dtype == scale_dtype
        _assert_state_bits(opt2.state[p2], {k: v.cpu() for k, v in opt.state[p].items() if k.startswith("exp")})


def test_state_dict_refusals():
    model = _model(4)
    forge_dsl.fuse(model)
    opt = ForgeOptimizer(model, "adamw", lr=1e-2, state_dtype="int4", rounding="nearest")
    _train(model, opt, 1)
    w = model[0].weight
    sd = opt.state_dict()
    idx = next(i for i, p in enumerate(opt.param_groups[0]["params"]) if p is w)
    # int4 bytes unpacked to one byte per element (an int8-shaped tensor): refused, naming the packed shape
    bad = {**sd, "state": {**sd["state"], idx: {**sd["state"][idx],
                                                "exp_avg": torch.zeros(128, 64, dtype=torch.int8)}}}
    fresh = ForgeOptimizer(_model(4), "adamw", lr=1e-2, state_dtype="int4")
    with pytest.raises(ValueError, match=re.escape("has shape (128, 64), the parameter (128, 64) (int4 codes, two a "
                                                   "byte: (128, 32))")):
        fresh.load_state_dict(bad)
    # an int4 checkpoint's state cast to fp32 (dcp.load into an fp32 optimizer): refused, naming the storage
    cast = {**sd, "state": {**sd["state"], idx: {**sd["state"][idx],
                                                 "exp_avg": sd["state"][idx]["exp_avg"].float()}}}
    with pytest.raises(ValueError, match="stores it as int8 bytes of two int4 codes each with a float32 or bfloat16 "
                                         r"'exp_avg.scale' of shape \(128, 1\)"):
        fresh.load_state_dict(cast)
    # scales of another dtype (a float16 cast) or shape: refused, naming both scale dtypes
    for bad_scale in (sd["state"][idx]["exp_avg.scale"].half(), sd["state"][idx]["exp_avg.scale"][:64]):
        recast = {**sd, "state": {**sd["state"], idx: {**sd["state"][idx], "exp_avg.scale": bad_scale}}}
        with pytest.raises(ValueError, match=r"'exp_avg.scale' of .* is torch.\w+ of shape \(\d+, 1\); int4 "
                                             r"'exp_avg' needs float32 or bfloat16 of shape \(128, 1\)"):
            fresh.load_state_dict(recast)
    no_scale = {**sd, "state": {**sd["state"], idx: {k: v for k, v in sd["state"][idx].items()
                                                     if k != "exp_avg.scale"}}}
    with pytest.raises(ValueError, match="state_dict's int4 'exp_avg' of .* has no 'exp_avg.scale'"):
        fresh.load_state_dict(no_scale)


def test_kernel_refusals(probe):
    w = torch.randn(4, 128, device=DEVICE)
    g = torch.randn(4, 128, device=DEVICE)
    state = forge_dsl.init_state(probe, w, layout="int4")
    bad_scale = {**state, "m.scale": torch.zeros(4, 4, device=DEVICE)}  # the scales of 256 columns
    needs = "a contiguous float32 or bfloat16 tensor of shape"
    with pytest.raises(ValueError, match=rf"int4 state 'm' needs 'm.scale', {needs} \(4, 2\)"):
        kernels.step(probe, w, g, bad_scale, step=1)
    for other in (state["m.scale"].half(), state["m.scale"].float().t().contiguous().t()):  # float16; a transpose
        with pytest.raises(ValueError, match=rf"int4 state 'm' needs 'm.scale', {needs} \(4, 2\)"):
            kernels.step(probe, w, g, {**state, "m.scale": other}, step=1)
    wrong = {**state, "m": torch.zeros(4, 32, dtype=torch.int8, device=DEVICE)}
    with pytest.raises(ValueError, match=re.escape("state 'm' has shape (4, 32) but the parameter has (4, 128) "
                                                   "(int4 state holds two codes a byte")):
        kernels.step(probe, w, g, wrong, step=1)
    no_scale = {k: v for k, v in state.items() if k != "v.scale"}
    with pytest.raises(ValueError, match=rf"int4 state 'v' needs 'v.scale', {needs} \(4, 2\)"):
        kernels.step(probe, w, g, no_scale, step=1)
    odd = torch.randn(4, 129, device=DEVICE)
    assert forge_dsl.init_state(probe, odd, layout="int4")["m"].dtype == torch.float32  # odd last dim: fp32


_EXACT = """optimizer int4_exact "a state that starts from param"

hyper lr = 0.1 in [0, inf)

state z = param
state m = 0

update {
    m = grad
    z = z - lr * m
    param = z
}
"""


def test_states_that_must_stay_exact_stay_fp32(tmp_path):
    path = tmp_path / "int4_exact.fopt"
    path.write_text(_EXACT)
    spec = forge_dsl.load_spec(str(path))
    p = torch.randn(4, 128, device=DEVICE)
    state = forge_dsl.init_state(spec, p, layout="int4")
    assert state["z"].dtype == torch.float32 and torch.equal(state["z"], p) and state["m"].dtype == torch.int8
    with pytest.raises(ValueError, match=r"state 'z' of int4_exact must stay in fp32 because it starts from param .*, "
                                         r"but the layout asks for 'int4'"):
        forge_dsl.init_state(spec, p, layout={"z": "int4"})
