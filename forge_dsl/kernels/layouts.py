"""Storage layouts of weights and optimizer state (torch side; the reference for the kernels).

A state tensor is stored in one of six layouts (`StateLayout`). The Triton
helpers in `forge_dsl.kernels.state_lib` read and write exactly these layouts,
with exactly the same fp32 formulas in the same order, so a kernel run in the
Triton interpreter, a kernel run on the GPU and the functions here agree bit
for bit.

Every tensor is seen as a row-major 2-D matrix `[rows, cols]` whose columns are
its last dimension (`as_rows`). The quantized layouts (8-bit and 4-bit) quantize
blocks of `BLOCK` = 64 consecutive elements along a row, with one scale per
block, stored as a `[rows, n_blocks(cols)]` tensor; the last block of a row
may be ragged (cols not a multiple of 64) and only its real elements set its scale.

Block scales are bfloat16 for new state (`SCALE_DTYPE`) or float32 (state written before bf16
scales: every such checkpoint keeps working, bit for bit); the scale tensor's dtype says which,
and a state keeps its scales' dtype as it is updated. Below, `scale` is the block maximum M
(taken on the bit patterns) for fp32 scales; for bf16 scales it is M ROUNDED UP to a bf16, on
the bits (`bf16_round_up_bits`): the high 16 bits of M, + 1 where its low 16 bits are nonzero;
NaN stays the one NaN 0x7FC0, +inf stays +inf, and a finite M above the largest finite bf16
(2 - 2**-7) * 2**127 saturates to it (never to inf, which would poison the block): then |x| / scale
< 1.0040 and the codes stay in range (INT8 |y| < 127.5; the UINT8_SQRT and INT4 counts are at
most 255 and 15 by construction; UINT4 u < 16.07 rounds to at most 16; INT8 and UINT4 clamp the
code as well). Every formula then uses that stored scale, so the decoded values follow the scale
exactly as stored. In fp32, M <= scale < M * (1 + 2**-7) (unsaturated): the scale is M rounded up
to 8 significant bits. Subnormal maxima round up like any other (a nonzero M never gives a zero scale).

Storage (`storage_dtype`, `storage_shape`, and `layout_of`, which tells a state tensor's layout from
its dtype and shape): FP32 / BF16 / INT8 / UINT8_SQRT hold one element per entry, shaped like the
parameter. The 4-bit layouts pack two codes per byte along a row, element 2j in the low nibble and
2j + 1 in the high one of byte j, so a state of a `[..., cols]` parameter is `[..., cols / 2]`: int8
for INT4, uint8 for UINT4 (the dtype says signed / nonneg as for the 8-bit layouts, the halved last
dim says 4-bit). They need an even number of columns (`resolve_layout` keeps a state of an odd last
dim in fp32), so a row's bytes never straddle rows and a tile's pairs never straddle tiles.

The formulas (all fp32, every operation rounded to nearest even):

INT8 (signed, `int8` storage):
    scale = max |x| over the block          (taken on the bit patterns, see below)
    inv   = 127 / scale                     (IEEE division)
    y     = x * inv                         (|y| <= 127 (1 + 2**-24)**2 < 127.5: no clamp needed)
    f     = floor(y)
    q     = f + 1 if y >= f + 0.5 else f    (= floor(y + 0.5) computed exactly)
    q     = 0 where the block is not valid (below)
    x'    = q * (scale / 127)               (IEEE division, then one multiply)

UINT8_SQRT (states declared nonneg, `uint8` storage):
    x     = +0 where x < 0 or x is -0 (NaN of either sign stays NaN; done on bits)
    scale = max x over the block
    inv   = 1 / scale                       (IEEE division, once per block)
    t     = x * inv                         (in [0, 1 + 2**-23])
    q     = #{k in 1..255 : t >= theta_k},  theta_k = c_k * c_k,  c_k = (k - 0.5) * R255
            (R255 = fp32(1/255); both products rounded to fp32); 0 where the block is not valid
    r     = q * R255
    x'    = (scale * r) * r
    The count is round-half-up of 255 * sqrt(t) with the half-way points computed in
    fp32: it differs from rounding the fp32 square root only for t within a few ulps of a
    half-way point. The kernels find it without an IEEE square root (an approximate root
    is off by at most one code, and one comparison with the next threshold corrects it).

INT4 (signed, `int8` storage, two codes a byte): the 16-value map of torchao's AdamW4bit first moment
(bitsandbytes' dynamic-exponent map, `create_dynamic_map(signed=True, max_exponent_bits=3, total_bits=4)`,
`INT4_MAP`, fp32): -0.8875 -0.6625 -0.4375 -0.2125 -0.0775 -0.0325 -0.0055 0 0.0055 0.0325 0.0775 0.2125
0.4375 0.6625 0.8875 1 (fine near zero: steps of 0.0055 to 0.045 below 0.08; not symmetric: -1 is absent)
    scale = max |x| over the block          (on the bit patterns; inf or NaN in the block: NaN)
    inv   = 1 / scale                       (IEEE division)
    y     = x * inv                         (in [-1 - 2**-23, 1 + 2**-23])
    q     = #{k in 1..15 : y >= mu_k},  mu_k = fp32((p_{k-1} + p_k) / 2), p = INT4_MAP
            (the nearest map value, ties up; `INT4_THRESHOLDS`); 7 (the value 0) where the block is not valid
    x'    = scale * p_q

UINT4 (states declared nonneg, `uint8` storage, two codes a byte): torchao's second-moment map, linear
without zero: p_q = (q + 1) / 16, q = 0..15, so no value decodes to 0 unless its block's scale is 0 (the
"zero-point problem" of 4-bit second moments, Li et al. 2023: a v decoded as 0 makes m / sqrt(v) explode)
    x     = +0 where x < 0 or x is -0 (NaN of either sign stays NaN; done on bits)
    scale = max x over the block            (inf or NaN in the block: NaN)
    inv   = 16 / scale                      (IEEE division, once per block)
    u     = x * inv                         (in [0, 16 (1 + 2**-23)])
    q     = max(f + 1 if u >= f + 0.5 else f, 1) - 1,  f = floor(u)   (0 where the block is not valid)
            (= #{k in 1..15 : u >= k + 0.5}, the nearest of 1..16, ties up: both exact)
    x'    = scale * ((q + 1) * 0.0625)      (the second product is exact)

A block is valid when its scale is finite, > 0, and its `inv` is finite (not for a
scale below about 1e-37 (INT8), 3e-39 (UINT8_SQRT, INT4) or 5e-38 (UINT4), whose reciprocal
overflows: such a block stores codes 0 (INT4: 7) and reads back as zeros, UINT4 as scale / 16).

Why "f + 1 if y >= f + 0.5" and not "floor(y + 0.5)": on the GPU the compiler
contracts a multiply followed by an add into one fused multiply-add, so
`floor(x * inv + 0.5)` would round once on the GPU and twice in the
interpreter. The comparison form never feeds a product into an add. It is
also the exact round-half-up of `y` (`floor(fl(y + 0.5))` is not, for y just
below 0.5).

The block maximum is taken on the fp32 bit patterns as int32 (`bits & 0x7FFFFFFF`),
which orders like the float values for non-NaN values and puts NaN above +inf:
both sides reduce integers, so the result is the same whatever the reduction
order, and a NaN in a block always becomes that block's scale, stored as the
one pattern 0x7FC00000 (bf16 scales: 0x7FC0). A block whose
scale is NaN or inf stores q = 0 and reads back as NaN (0 * inf = NaN): a
non-finite state poisons its block, deterministically, on every backend (the
NaN *payloads* of decoded values are not pinned: GPU arithmetic returns
0x7FFFFFFF, x86 returns other patterns). The 4-bit layouts store an inf block's
scale as that NaN too (UINT4 has no zero code to turn inf into NaN), so they poison
their blocks the same way.

Error bounds (apart from a few fp32 ulps of scale; `scale` the STORED scale, so with bf16 scales each
bound, relative to the block maximum M, is larger by the rounding-up factor scale / M < 1 + 2**-7, and a
saturated block (M above the largest finite bf16) also errs by up to M - scale < 0.004 M at its maximum):
    INT8:       |x - x'| <= scale / 254 (half a step)
    UINT8_SQRT: |x - x'| <= half the gap between the two codes bracketing x,
                plus scale / (4 * 255**2); rounding happens in the sqrt domain, so a
                value just above the midpoint of u = sqrt(x/scale)*255 goes to the
                upper code, which in the linear domain is up to scale / (4 * 255**2)
                farther than half the gap.
    INT4:       |x - x'| <= scale * (the distance from x / scale to the nearest map value)
                <= 0.1125 * scale (half the widest gap, and -1 to -0.8875); below
                0.08 * scale at most 0.0225 * scale, below 0.0055 * scale at most 0.00275 * scale.
    UINT4:      |x - x'| <= scale / 32 (half a step) for x >= scale / 32, and
                scale / 16 - x below (the map's smallest value is scale / 16); x' >= scale / 16 > 0.

bf16 conversion is done on integer bits (`bf16_round_nearest_bits`,
`bf16_from_bits`): round to nearest even, NaN → 0x7FFF, ±inf kept, subnormals
rounded like any other value (no flushing) — the same as torch's
`x.to(torch.bfloat16)`.
"""

from __future__ import annotations

import enum
import math
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = [
    "BLOCK",
    "StateLayout",
    "LAYOUT_NAMES",
    "R255",
    "INT4_MAP",
    "INT4_THRESHOLDS",
    "QUANTIZED_LAYOUTS",
    "FOUR_BIT_LAYOUTS",
    "layout_of",
    "storage_shape",
    "is_quantized",
    "holds_codes",
    "as_rows",
    "n_blocks",
    "resolve_layout",
    "quantized_layout",
    "storage_dtype",
    "quantize",
    "dequantize",
    "bf16_round_nearest_bits",
    "bf16_from_bits",
    "SCALE_DTYPE",
    "SCALE_DTYPES",
    "check_scale_dtype",
    "bf16_round_up_bits",
]

BLOCK = 64  # int8 quantization block: 64 consecutive elements along a row (last dim)

# fp32(1/255): the constant both sides multiply by in the UINT8_SQRT decode.
R255 = float(torch.tensor(1.0 / 255.0, dtype=torch.float32).item())


def _sqrt_thresholds() -> Tensor:
    """theta_1..theta_255 of the UINT8_SQRT encode, fp32 [255], strictly increasing."""
    c = (torch.arange(1, 256, dtype=torch.float32) - 0.5) * torch.tensor(R255, dtype=torch.float32)
    return c * c


_SQRT_THRESHOLDS = _sqrt_thresholds()

# The INT4 map (torchao's / bitsandbytes' 4-bit dynamic-exponent map) as fp32, ascending; code 7 is 0.
INT4_MAP = torch.tensor([-0.8875, -0.6625, -0.4375, -0.2125, -0.0775, -0.0325, -0.0055, 0.0,
                         0.0055, 0.0325, 0.0775, 0.2125, 0.4375, 0.6625, 0.8875, 1.0], dtype=torch.float32)
# mu_1..mu_15 of the INT4 encode: the midpoints of neighbouring map values, rounded to fp32 (the kernels
# spell the same 15 numbers as literals, `state_lib._int4_code`).
INT4_THRESHOLDS = ((INT4_MAP[:-1].double() + INT4_MAP[1:].double()) / 2).to(torch.float32)
INT4_ZERO = 7  # the INT4 code of 0

LAYOUT_NAMES = ("fp32", "bf16", "int8", "int4")
QUANTIZED_NAMES = ("int8", "int4")  # the names whose states are block-quantized codes beside scales

# The storage dtype of the block scales of new quantized state (`quantize`, `api.init_state`); a scale tensor's
# own dtype, one of SCALE_DTYPES, tells how it is read (float32: every checkpoint before bf16 scales).
SCALE_DTYPE = torch.bfloat16
SCALE_DTYPES = (torch.float32, torch.bfloat16)
BF16_MAX_BITS = 0x7F7F  # the largest finite bf16, (2 - 2**-7) * 2**127


class StateLayout(enum.IntEnum):
    FP32 = 0  # float32 storage
    BF16 = 1  # bfloat16 storage (round-to-nearest-even on write)
    INT8 = 2  # signed: int8 q in [-127, 127], scale = absmax of the block (fp32); x ≈ q * scale / 127
    UINT8_SQRT = 3  # unsigned (states declared nonneg): uint8 q in [0, 255], scale = max of block; x ≈ scale * (q / 255)**2
    INT4 = 4  # signed, two codes a byte (int8 storage [..., cols / 2]): x ≈ scale * INT4_MAP[q], scale = absmax of block
    UINT4 = 5  # unsigned (states declared nonneg), two codes a byte (uint8 storage): x ≈ scale * (q + 1) / 16

    @property
    def layout_name(self) -> str:
        """The `LAYOUT_NAMES` entry that gives this layout ("int8" and "int4" give a nonneg state the unsigned maps)."""
        return _LAYOUT_TEXT[self][0]

    @property
    def words(self) -> str:
        """How messages and `describe()` name it: "uint8 (sqrt map)" for UINT8_SQRT."""
        return _LAYOUT_TEXT[self][1]

    @property
    def storage_words(self) -> str:
        """What its storage holds, for messages: "int8 codes", "uint8 bytes of two int4 codes each ...", "float32"."""
        return _LAYOUT_TEXT[self][2]


# Each layout's name (`LAYOUT_NAMES`), its words and its storage's words: the one table of both (`StateLayout`).
_LAYOUT_TEXT = {
    StateLayout.FP32: ("fp32", "fp32", "torch.float32"),
    StateLayout.BF16: ("bf16", "bf16", "torch.bfloat16"),
    StateLayout.INT8: ("int8", "int8", "int8 codes"),
    StateLayout.UINT8_SQRT: ("int8", "uint8 (sqrt map)", "uint8 codes (the sqrt map of a nonneg state)"),
    StateLayout.INT4: ("int4", "int4", "int8 bytes of two int4 codes each"),
    StateLayout.UINT4: ("int4", "uint4 (no-zero map)",
                        "uint8 bytes of two int4 codes each (the no-zero map of a nonneg state)"),
}


_STORAGE_DTYPES = {
    StateLayout.FP32: torch.float32,
    StateLayout.BF16: torch.bfloat16,
    StateLayout.INT8: torch.int8,
    StateLayout.UINT8_SQRT: torch.uint8,
    StateLayout.INT4: torch.int8,
    StateLayout.UINT4: torch.uint8,
}


def rows_cols(shape: Sequence[int]) -> Tuple[int, int]:
    """The `[rows, cols]` that `as_rows` views a tensor of this shape as."""
    shape = tuple(int(s) for s in shape)
    if len(shape) == 0:
        return 1, 1
    return math.prod(shape[:-1]), shape[-1]


def as_rows(t: Tensor) -> Tensor:
    """2-D view `[rows, cols]` of `t`: cols = last dim; 1-D → `[1, n]`; 0-dim → `[1, 1]`.

    A view when `t` is contiguous (a copy otherwise, like `Tensor.reshape`).
    """
    rows, cols = rows_cols(t.shape)
    return t.reshape(rows, cols)


def n_blocks(cols: int) -> int:
    """Number of quantization blocks in a row of `cols` elements: ceil(cols / 64)."""
    return -(-int(cols) // BLOCK)


def resolve_layout(name: str, nonneg: bool, shape: Sequence[int]) -> StateLayout:
    """The layout of one state tensor.

    Args:
        name: the requested storage, one of "fp32", "bf16", "int8", "int4".
        nonneg: the state is declared nonneg (int8 / int4 then use their unsigned maps).
        shape: the state's shape (that of its parameter).

    "int8" gives INT8 or UINT8_SQRT by `nonneg`, "int4" INT4 or UINT4, but both give
    FP32 when the last dim is smaller than one block (64): states smaller than a block
    stay fp32; "int4" also gives FP32 for an odd last dim (two codes share a byte, and
    a row's last byte would hold a code of the next row).
    """
    if isinstance(name, StateLayout):
        return name
    if not isinstance(name, str) or name not in LAYOUT_NAMES:
        raise ValueError(
            f"unknown state layout {name!r}: expected one of {', '.join(repr(n) for n in LAYOUT_NAMES)}"
        )
    if name == "fp32":
        return StateLayout.FP32
    if name == "bf16":
        return StateLayout.BF16
    _, cols = rows_cols(shape)
    if cols < BLOCK or (name == "int4" and cols % 2):
        return StateLayout.FP32
    return quantized_layout(name, nonneg)


def quantized_layout(name: str, nonneg: bool) -> StateLayout:
    """The layout "int8" or "int4" (`QUANTIZED_NAMES`) stores a state in, by whether it is declared nonneg: the
    unsigned maps (UINT8_SQRT, UINT4: uint8 storage) for nonneg states, the signed ones (INT8, INT4: int8) for
    the others. `resolve_layout` picks by it, and the kernels' checks refuse codes of the other map by it
    (`checks.check_state_kind`)."""
    if name == "int4":
        return StateLayout.UINT4 if nonneg else StateLayout.INT4
    if name == "int8":
        return StateLayout.UINT8_SQRT if nonneg else StateLayout.INT8
    raise ValueError(f"{name!r} is not a quantized layout; expected one of {', '.join(map(repr, QUANTIZED_NAMES))}")


def storage_dtype(layout) -> torch.dtype:
    """float32, bfloat16, int8, uint8, int8, uint8 for FP32, BF16, INT8, UINT8_SQRT, INT4, UINT4."""
    return _STORAGE_DTYPES[StateLayout(layout)]


QUANTIZED_LAYOUTS = frozenset({StateLayout.INT8, StateLayout.UINT8_SQRT, StateLayout.INT4, StateLayout.UINT4})
FOUR_BIT_LAYOUTS = frozenset({StateLayout.INT4, StateLayout.UINT4})  # two codes a byte
_BYTE_LAYOUTS = {torch.int8: (StateLayout.INT8, StateLayout.INT4), torch.uint8: (StateLayout.UINT8_SQRT, StateLayout.UINT4)}
_WHOLE_LAYOUTS = {torch.float32: StateLayout.FP32, torch.bfloat16: StateLayout.BF16}


def storage_shape(layout, param_shape: Sequence[int]) -> Tuple[int, ...]:
    """The shape of a state's storage in `layout` for a parameter of `param_shape`: the parameter's, but
    `[..., cols / 2]` for the 4-bit layouts (whose `resolve_layout` guarantees an even cols >= 64)."""
    shape = tuple(int(s) for s in param_shape)
    if StateLayout(layout) in FOUR_BIT_LAYOUTS:
        return shape[:-1] + (shape[-1] // 2,)
    return shape


def layout_of(t: Tensor, param_shape: Optional[Sequence[int]] = None, *, scale: Optional[Tensor] = None
              ) -> Optional[StateLayout]:
    """The layout a state tensor holds, or None where no layout stores its dtype.

    float32 and bfloat16 storage: FP32 and BF16. int8 / uint8 storage holds 8-bit codes (INT8 /
    UINT8_SQRT) or 4-bit pairs (INT4 / UINT4), told apart by the shape: given the parameter's shape,
    4-bit where `t` is `storage_shape(INT4, param_shape)` (the parameter's last dim halved, never the
    parameter's own shape); given only the codes' block `scale` `[rows, nb]` (where no parameter is at
    hand, e.g. a state dict's entries), 4-bit where the scales cover twice the codes' columns (8-bit
    codes have cols >= 64 and n_blocks(cols) scales a row). Other shapes are the caller's to refuse
    (`storage_shape`); with neither argument, int8 / uint8 read as their 8-bit layouts.
    """
    whole = _WHOLE_LAYOUTS.get(t.dtype)
    if whole is not None:
        return whole
    pair = _BYTE_LAYOUTS.get(t.dtype)
    if pair is None:
        return None
    eight, four = pair
    if param_shape is not None:
        shape = tuple(int(s) for s in param_shape)
        half = storage_shape(four, shape) if shape and shape[-1] >= BLOCK and shape[-1] % 2 == 0 else None
        return four if tuple(t.shape) == half else eight
    if scale is not None and t.dim() > 0:
        cols = t.shape[-1]
        return four if cols < BLOCK or scale.shape[-1] != n_blocks(cols) else eight
    return eight


def is_quantized(layout) -> bool:
    """Whether a layout (or layout code) stores block-quantized codes beside a `<name>.scale` tensor."""
    return layout in QUANTIZED_LAYOUTS


def holds_codes(t: Tensor) -> bool:
    """Whether a state tensor holds block-quantized codes, 8-bit or 4-bit (int8 or uint8 storage; its scales sit
    beside it under `<name>.scale`)."""
    return t.dtype in _BYTE_LAYOUTS


def bf16_round_nearest_bits(x: Tensor) -> Tensor:
    """fp32 → bf16 bit patterns (int16), round to nearest even, on integer bits.

    NaN → 0x7FFF (quiet NaN, whatever the sign or payload: the pattern the GPU's conversion
    instruction gives); ±inf stay ±inf; finite
    values past the largest bf16 round to ±inf; subnormals round like any value.
    """
    x = x.to(torch.float32)
    b = x.contiguous().view(torch.int32)
    # int32 arithmetic cannot overflow here for non-NaN inputs: the largest
    # magnitude bits are 0x7F800000 (inf) and the add is at most 0x8000.
    r = (b + (0x7FFF + ((b >> 16) & 1))) >> 16
    r = torch.where(torch.isnan(x), torch.full_like(r, 0x7FFF), r)
    return r.to(torch.int16)


def bf16_from_bits(bits: Tensor) -> Tensor:
    """bf16 bit patterns (int16, or a bfloat16 tensor) → float32 (exact)."""
    if bits.dtype == torch.bfloat16:
        bits = bits.view(torch.int16)
    if bits.dtype != torch.int16:
        raise TypeError(f"bf16_from_bits expects int16 bits, got {bits.dtype}")
    w = (bits.to(torch.int32) & 0xFFFF) << 16
    return w.view(torch.float32)


def check_scale_dtype(dtype, what: str = "scale_dtype") -> torch.dtype:
    """`dtype` if it is a block scales' storage dtype (float32 or bfloat16), else a TypeError naming `what`."""
    if dtype not in SCALE_DTYPES:
        raise TypeError(f"{what} must be torch.float32 or torch.bfloat16 (block scales), got {dtype}")
    return dtype


def bf16_round_up_bits(amax: Tensor) -> Tensor:
    """Block maxima (fp32, >= +0 or the NaN 0x7FC00000) → bf16 scales as int32 bit patterns [0, 0x7FC0], rounded
    UP: the high 16 bits, + 1 where the low 16 are nonzero; NaN stays 0x7FC0, +inf 0x7F80, and a finite maximum
    above the largest finite bf16 saturates to it (0x7F7F), never to inf."""
    bits = amax.contiguous().view(torch.int32)
    up = (bits >> 16) + ((bits & 0xFFFF) != 0).to(torch.int32)
    return torch.where(bits < 0x7F800000, up.clamp_max(BF16_MAX_BITS), up)


def _padded_blocks(x2: Tensor) -> Tuple[Tensor, int]:
    """[rows, cols] fp32 → [rows, nb, 64] with zero padding past cols."""
    rows, cols = x2.shape
    nb = n_blocks(cols)
    pad = nb * BLOCK - cols
    if pad:
        x2 = torch.nn.functional.pad(x2, (0, pad))
    return x2.reshape(rows, nb, BLOCK), nb


def _block_absmax(x3: Tensor) -> Tensor:
    """max |x| over the last axis, on the bit patterns (NaN above inf), fp32 [rows, nb]."""
    bits = x3.contiguous().view(torch.int32) & 0x7FFFFFFF
    if bits.shape[-1] == 0 or bits.numel() == 0:
        return torch.zeros(bits.shape[:-1], dtype=torch.float32, device=x3.device)
    amax = bits.amax(dim=-1)
    amax = torch.where(amax > 0x7F800000, torch.full_like(amax, 0x7FC00000), amax)  # one NaN pattern
    return amax.view(torch.float32)


def _clamp_nonneg(x: Tensor) -> Tensor:
    """Negatives and -0 → +0, NaN (either sign) kept: on integer bits, as the kernels do."""
    bits = x.contiguous().view(torch.int32)
    mag = bits & 0x7FFFFFFF
    zero = torch.zeros_like(mag)
    mag = torch.where(bits < 0, torch.where(mag > 0x7F800000, mag, zero), mag)
    return mag.view(torch.float32)


def _round_half_up(y: Tensor) -> Tensor:
    f = torch.floor(y)
    return torch.where(y >= f + 0.5, f + 1.0, f)


def _valid_scale(scale: Tensor) -> Tensor:
    return (scale > 0) & (scale < math.inf)


def _pack_pairs(q: Tensor) -> Tensor:
    """[rows, cols] codes in 0..15 (cols even) → [rows, cols / 2] uint8 bytes: low nibble the even column."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def _unpack_pairs(b: Tensor) -> Tensor:
    """[rows, c] bytes (int8 or uint8) → [rows, 2c] codes 0..15 as int64 (inverse of `_pack_pairs`)."""
    b = b.to(torch.int64) & 0xFF
    return torch.stack([b & 0xF, b >> 4], dim=-1).reshape(b.shape[0], 2 * b.shape[1])


def quantize(x: Tensor, layout, scale_dtype: torch.dtype = SCALE_DTYPE) -> Tuple[Tensor, Optional[Tensor]]:
    """Encode `x` (any float dtype and shape) in `layout`.

    Returns `(storage, scale)`: `storage` of `storage_shape(layout, x.shape)` (x's shape; its last
    dim halved for the 4-bit layouts) in `storage_dtype(layout)`; `scale` a `[rows, n_blocks(cols)]`
    tensor of `scale_dtype` (bfloat16, the default `SCALE_DTYPE`, or float32) for the quantized layouts,
    else None.

    Raises:
        ValueError: a 4-bit layout for an `x` whose last dim is odd (`resolve_layout` never picks one).
        TypeError: a `scale_dtype` other than float32 and bfloat16.
    """
    layout = StateLayout(layout)
    check_scale_dtype(scale_dtype)
    x = x.detach().to(torch.float32)
    if layout == StateLayout.FP32:
        return x.clone(), None
    if layout == StateLayout.BF16:
        return bf16_round_nearest_bits(x).view(torch.bfloat16).reshape(x.shape), None

    x2 = as_rows(x)
    rows, cols = x2.shape
    four = layout in FOUR_BIT_LAYOUTS
    if four and cols % 2:
        raise ValueError(f"{layout.name} packs two codes a byte along a row and needs an even last dim, got shape "
                         f"{tuple(x.shape)}")
    if layout in (StateLayout.UINT8_SQRT, StateLayout.UINT4):
        x2 = _clamp_nonneg(x2)
    x3, nb = _padded_blocks(x2)
    scale = _block_absmax(x3)  # [rows, nb]
    if four:  # an inf block's scale is the NaN pattern too
        scale = torch.where(torch.isinf(scale), torch.full_like(scale, math.nan), scale)
    if scale_dtype == torch.bfloat16:  # rounded up, so the codes below are computed against the stored scale
        scale = (bf16_round_up_bits(scale) << 16).view(torch.float32)
    ok = _valid_scale(scale)
    s3 = scale[..., None]
    ok3 = ok[..., None]
    # INT8: y = x * (127 / scale); UINT4: u = x * (16 / scale); UINT8_SQRT, INT4: x * (1 / scale). One division
    # per block, not per element.
    inv = torch.full_like(s3, _INV_NUMERATOR[layout]) / s3
    ok3 = ok3 & (inv < math.inf)  # a tiny scale's reciprocal overflows: codes 0
    inv = torch.where(ok3, inv, torch.zeros_like(inv))
    y = torch.where(ok3, x3, torch.zeros_like(x3)) * inv
    if layout == StateLayout.INT8:
        q = _round_half_up(y).clamp(-127.0, 127.0).to(torch.int8)
    elif layout == StateLayout.UINT8_SQRT:
        thresholds = _SQRT_THRESHOLDS.to(y.device)
        q = torch.searchsorted(thresholds, y.contiguous(), right=True).to(torch.uint8)  # thresholds <= y
    elif layout == StateLayout.INT4:
        q = torch.searchsorted(INT4_THRESHOLDS.to(y.device), y.contiguous(), right=True)  # invalid blocks: y = 0 → 7
    else:
        q = (_round_half_up(y) - 1.0).clamp(0.0, 15.0).to(torch.int64)
    q = q.reshape(rows, nb * BLOCK)[:, :cols]
    if four:
        packed = _pack_pairs(q)
        if layout == StateLayout.INT4:
            packed = packed.view(torch.int8)
        return packed.reshape(storage_shape(layout, x.shape)).contiguous(), _stored_scale(scale, scale_dtype)
    return q.reshape(x.shape).contiguous(), _stored_scale(scale, scale_dtype)


def _stored_scale(scale: Tensor, scale_dtype: torch.dtype) -> Tensor:
    """fp32 scales (bf16 values already, for bfloat16) → their storage (the high 16 bits: exact)."""
    if scale_dtype == torch.bfloat16:
        return (scale.contiguous().view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)
    return scale.contiguous()


_INV_NUMERATOR = {StateLayout.INT8: 127.0, StateLayout.UINT8_SQRT: 1.0, StateLayout.INT4: 1.0, StateLayout.UINT4: 16.0}


def dequantize(storage: Tensor, scale: Optional[Tensor], layout) -> Tensor:
    """Decode `storage` (and its block `scale`, float32 or bfloat16) from `layout` → fp32 tensor shaped like
    the parameter: like `storage`, its last dim doubled for the 4-bit layouts."""
    layout = StateLayout(layout)
    if layout == StateLayout.FP32:
        return storage.to(torch.float32)
    if layout == StateLayout.BF16:
        if storage.dtype not in (torch.bfloat16, torch.int16):
            raise TypeError(f"BF16 storage must be bfloat16 (or its int16 view), got {storage.dtype}")
        return bf16_from_bits(storage.contiguous().view(torch.int16)).reshape(storage.shape)
    want = storage_dtype(layout)
    if storage.dtype != want:
        raise TypeError(f"{layout.name} storage must be {want}, got {storage.dtype}")
    if scale is None:
        raise ValueError(f"{layout.name} storage needs its block scale")
    q2 = as_rows(storage)
    if layout in FOUR_BIT_LAYOUTS:
        if storage.dim() == 0:
            raise ValueError(f"{layout.name} storage holds pairs of codes along its last dim; got a 0-dim tensor")
        q2 = _unpack_pairs(q2)
    rows, cols = q2.shape
    nb = n_blocks(cols)
    if tuple(scale.shape) != (rows, nb):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match storage: expected {(rows, nb)}")
    check_scale_dtype(scale.dtype, f"{layout.name} block scale dtype")
    scale = bf16_from_bits(scale.contiguous().view(torch.int16)) if scale.dtype == torch.bfloat16 else scale
    qf = q2.to(torch.float32)
    if layout == StateLayout.INT8:
        step = scale / torch.full_like(scale, 127.0)
        s = step.repeat_interleave(BLOCK, dim=1)[:, :cols]
        out = qf * s
    elif layout == StateLayout.UINT8_SQRT:
        s = scale.repeat_interleave(BLOCK, dim=1)[:, :cols]
        r = qf * R255
        out = (s * r) * r
    else:
        s = scale.repeat_interleave(BLOCK, dim=1)[:, :cols]
        p = INT4_MAP.to(qf.device)[q2] if layout == StateLayout.INT4 else (qf + 1.0) * 0.0625
        out = s * p
        return out.reshape(tuple(storage.shape[:-1]) + (cols,))
    return out.reshape(storage.shape)
