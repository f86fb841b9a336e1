"""Storage layouts of weights and optimizer state (torch side; the reference for the kernels).

A state tensor is stored in one of four layouts (`StateLayout`). The Triton
helpers in `forge_dsl.kernels.triton_lib` read and write exactly these layouts,
with exactly the same fp32 formulas in the same order, so a kernel run in the
Triton interpreter, a kernel run on the GPU and the functions here agree bit
for bit.

Every tensor is seen as a row-major 2-D matrix `[rows, cols]` whose columns are
its last dimension (`as_rows`). Int8 layouts quantize blocks of `BLOCK` = 64
consecutive elements along a row, with one fp32 scale per block, stored as a
`[rows, n_blocks(cols)]` fp32 tensor; the last block of a row may be ragged
(cols not a multiple of 64) and only its real elements set its scale.

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

A block is valid when its scale is finite, > 0, and its `inv` is finite (not for a
scale below about 1e-37 (INT8) or 3e-39 (UINT8_SQRT), whose reciprocal overflows: such a
block stores codes 0 and reads back as zeros).

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
one pattern 0x7FC00000. A block whose
scale is NaN or inf stores q = 0 and reads back as NaN (0 * inf = NaN): a
non-finite state poisons its block, deterministically, on every backend (the
NaN *payloads* of decoded values are not pinned: GPU arithmetic returns
0x7FFFFFFF, x86 returns other patterns).

Error bounds (apart from a few fp32 ulps of scale):
    INT8:       |x - x'| <= scale / 254 (half a step)
    UINT8_SQRT: |x - x'| <= half the gap between the two codes bracketing x,
                plus scale / (4 * 255**2); rounding happens in the sqrt domain, so a
                value just above the midpoint of u = sqrt(x/scale)*255 goes to the
                upper code, which in the linear domain is up to scale / (4 * 255**2)
                farther than half the gap.

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
    "as_rows",
    "n_blocks",
    "resolve_layout",
    "storage_dtype",
    "quantize",
    "dequantize",
    "bf16_round_nearest_bits",
    "bf16_from_bits",
]

BLOCK = 64  # int8 quantization block: 64 consecutive elements along a row (last dim)

# fp32(1/255): the constant both sides multiply by in the UINT8_SQRT decode.
R255 = float(torch.tensor(1.0 / 255.0, dtype=torch.float32).item())


def _sqrt_thresholds() -> Tensor:
    """theta_1..theta_255 of the UINT8_SQRT encode, fp32 [255], strictly increasing."""
    c = (torch.arange(1, 256, dtype=torch.float32) - 0.5) * torch.tensor(R255, dtype=torch.float32)
    return c * c


_SQRT_THRESHOLDS = _sqrt_thresholds()

LAYOUT_NAMES = ("fp32", "bf16", "int8")


class StateLayout(enum.IntEnum):
    FP32 = 0  # float32 storage
    BF16 = 1  # bfloat16 storage (round-to-nearest-even on write)
    INT8 = 2  # signed: int8 q in [-127, 127], scale = absmax of the block (fp32); x ≈ q * scale / 127
    UINT8_SQRT = 3  # unsigned (states declared nonneg): uint8 q in [0, 255], scale = max of block; x ≈ scale * (q / 255)**2


_STORAGE_DTYPES = {
    StateLayout.FP32: torch.float32,
    StateLayout.BF16: torch.bfloat16,
    StateLayout.INT8: torch.int8,
    StateLayout.UINT8_SQRT: torch.uint8,
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
    """Number of int8 blocks in a row of `cols` elements: ceil(cols / 64)."""
    return -(-int(cols) // BLOCK)


def resolve_layout(name: str, nonneg: bool, shape: Sequence[int]) -> StateLayout:
    """The layout of one state tensor.

    Args:
        name: the requested storage, one of "fp32", "bf16", "int8".
        nonneg: the state is declared nonneg (int8 then uses the unsigned sqrt map).
        shape: the state's shape (that of its parameter).

    "int8" gives INT8 or UINT8_SQRT by `nonneg`, but FP32 when the last dim is
    smaller than one block (64): states smaller than a block stay fp32.
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
    if cols < BLOCK:
        return StateLayout.FP32
    return StateLayout.UINT8_SQRT if nonneg else StateLayout.INT8


def storage_dtype(layout) -> torch.dtype:
    """float32, bfloat16, int8 or uint8 for FP32, BF16, INT8, UINT8_SQRT."""
    return _STORAGE_DTYPES[StateLayout(layout)]


_LAYOUT_OF_DTYPE = {dtype: layout for layout, dtype in _STORAGE_DTYPES.items()}
QUANTIZED_LAYOUTS = frozenset({StateLayout.INT8, StateLayout.UINT8_SQRT})  # codes plus per-block fp32 scales


def layout_of_dtype(dtype: torch.dtype) -> Optional[StateLayout]:
    """The layout a state tensor of this storage dtype holds (None: no layout stores it)."""
    return _LAYOUT_OF_DTYPE.get(dtype)


def is_quantized(layout) -> bool:
    """Whether a layout (or layout code) stores block-quantized codes beside a `<name>.scale` tensor."""
    return layout in QUANTIZED_LAYOUTS


def holds_codes(t: Tensor) -> bool:
    """Whether a state tensor holds block-quantized codes (int8 or uint8 storage; its scales sit beside it)."""
    return is_quantized(_LAYOUT_OF_DTYPE.get(t.dtype))


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


def quantize(x: Tensor, layout) -> Tuple[Tensor, Optional[Tensor]]:
    """Encode `x` (any float dtype and shape) in `layout`.

    Returns `(storage, scale)`: `storage` shaped like `x` in `storage_dtype(layout)`;
    `scale` a `[rows, n_blocks(cols)]` fp32 tensor for the int8 layouts, else None.
    """
    layout = StateLayout(layout)
    x = x.detach().to(torch.float32)
    if layout == StateLayout.FP32:
        return x.clone(), None
    if layout == StateLayout.BF16:
        return bf16_round_nearest_bits(x).view(torch.bfloat16).reshape(x.shape), None

    x2 = as_rows(x)
    rows, cols = x2.shape
    if layout == StateLayout.UINT8_SQRT:
        x2 = _clamp_nonneg(x2)
    x3, nb = _padded_blocks(x2)
    scale = _block_absmax(x3)  # [rows, nb]
    ok = _valid_scale(scale)
    s3 = scale[..., None]
    ok3 = ok[..., None]
    # INT8: y = x * (127 / scale); UINT8_SQRT: t = x * (1 / scale). One division per block, not per element.
    inv = torch.full_like(s3, 127.0 if layout == StateLayout.INT8 else 1.0) / s3
    ok3 = ok3 & (inv < math.inf)  # a tiny scale's reciprocal overflows: codes 0
    inv = torch.where(ok3, inv, torch.zeros_like(inv))
    y = torch.where(ok3, x3, torch.zeros_like(x3)) * inv
    if layout == StateLayout.INT8:
        q = _round_half_up(y).to(torch.int8)
    else:
        thresholds = _SQRT_THRESHOLDS.to(y.device)
        q = torch.searchsorted(thresholds, y.contiguous(), right=True).to(torch.uint8)  # thresholds <= y
    q = q.reshape(rows, nb * BLOCK)[:, :cols].reshape(x.shape).contiguous()
    return q, scale.contiguous()


def dequantize(storage: Tensor, scale: Optional[Tensor], layout) -> Tensor:
    """Decode `storage` (and its block `scale`) from `layout` → fp32 tensor shaped like `storage`."""
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
    rows, cols = q2.shape
    nb = n_blocks(cols)
    if tuple(scale.shape) != (rows, nb):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match storage: expected {(rows, nb)}")
    scale = scale.to(torch.float32)
    qf = q2.to(torch.float32)
    if layout == StateLayout.INT8:
        step = scale / torch.full_like(scale, 127.0)
        s = step.repeat_interleave(BLOCK, dim=1)[:, :cols]
        out = qf * s
    else:
        s = scale.repeat_interleave(BLOCK, dim=1)[:, :cols]
        r = qf * R255
        out = (s * r) * r
    return out.reshape(storage.shape)
