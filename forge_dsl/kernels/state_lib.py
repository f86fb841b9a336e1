"""Triton helpers that read and write optimizer state in its layouts (`forge_dsl.kernels.layouts`).

Every helper works on a 2-D register tile `[BLOCK_N, BLOCK_K]` of a row-major,
contiguous 2-D tensor with `n_cols` columns; `BLOCK_K` is a multiple of 64, so an int8 block (64 consecutive
elements of a row) never straddles two tiles. What keeps the interpreter, the compiled kernel and the torch
reference bit for bit equal is said in `tile_lib`'s docstring.

Layout codes are the plain ints of `forge_dsl.kernels.layouts.StateLayout`:
0 = FP32, 1 = BF16, 2 = INT8, 3 = UINT8_SQRT, 4 = INT4, 5 = UINT4.

The 4-bit layouts hold two codes a byte (element `offs` in byte `offs >> 1`, the low nibble for an
even `offs`): that is the packed `[rows, cols / 2]` storage only because every row has an even number
of columns (`forge_dsl.kernels.layouts.resolve_layout` keeps odd ones fp32) and tiles start at even columns.
With NIBBLE_WORDS (rows of a multiple of 8 columns in storage that starts on a 4-byte boundary:
`kernel_calls.nibble_words`) the 8 elements of a row from each column multiple of 8 on share one
little-endian 32-bit word, element e of it in bits 4e..4e+3, and the helpers load and store one int32
word per 8 elements (`_load_codes`, `_store_codes`), gathered by reshaping to
`(BLOCK_N, BLOCK_K // 8, 8)` as the block scales are gathered over 64. Otherwise loads read each
element's byte and shift its nibble out, and stores pair neighbours with
`tl.reshape(..., (BLOCK_N, BLOCK_K // 2, 2))` + `tl.split` and write one byte per pair. The bytes are
the same either way.

Masks: `mask` must be the in-bounds mask of the tile (as from `tile_offsets`),
possibly further restricted to whole rows. The int8 helpers set a block's scale
from the unmasked elements only, so masking part of a block that is inside the
tensor would leave the masked elements' codes with a stale scale.
"""

import triton
import triton.language as tl

from .tile_lib import bf16_bits_to_fp32, fp32_to_bf16_bits_rne

# Layout codes, equal to forge_dsl.kernels.layouts.StateLayout. Module-level constants
# must be `tl.constexpr(...)` objects for jit code to read them (the interpreter
# accepts plain globals, the compiler does not).
LAYOUT_FP32 = tl.constexpr(0)
LAYOUT_BF16 = tl.constexpr(1)
LAYOUT_INT8 = tl.constexpr(2)
LAYOUT_UINT8_SQRT = tl.constexpr(3)
LAYOUT_INT4 = tl.constexpr(4)
LAYOUT_UINT4 = tl.constexpr(5)

QBLOCK = tl.constexpr(64)  # forge_dsl.kernels.layouts.BLOCK
# fp32(1/255), the exact constant forge_dsl.kernels.layouts.R255.
# (The jit code spells these three as literals: the 3.9 interpreter cannot do
# `int % constexpr`, and literals behave the same everywhere.)
R255 = tl.constexpr(0.003921568859368563)
FLT_MAX = tl.constexpr(3.4028234663852886e38)

__all__ = [
    "LAYOUT_FP32",
    "LAYOUT_BF16",
    "LAYOUT_INT8",
    "LAYOUT_UINT8_SQRT",
    "LAYOUT_INT4",
    "LAYOUT_UINT4",
    "block_scale_offsets",
    "load_state",
    "load_state_raw",
    "decode_state",
    "store_state",
]


# ---------------------------------------------------------------------------
# state
# ---------------------------------------------------------------------------


@triton.jit
def _block_mask(mask, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K // 64]: the block holds at least one unmasked element."""
    m3 = tl.reshape(mask.to(tl.int32), (BLOCK_N, BLOCK_K // 64, 64))
    return tl.max(m3, axis=2) > 0


@triton.jit
def block_scale_offsets(offs_n, k_start, n_blocks, BLOCK_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K // 64] int64 offsets of a tile's block scales in a `[rows, n_blocks]` scale
    tensor: row * n_blocks + column // 64, for rows offs_n [BLOCK_N] and columns k_start + [0, BLOCK_K)
    (k_start a multiple of 64). The state helpers take them as `scale_offs`; the warp-specialized
    kernel builds its own in Gluon (`gluon_lib.ws_slice_offsets`). A slice narrower than a block
    (BLOCK_K < 64, never with int8 state: `checks.check_config`) gets [BLOCK_N, 1], its block's."""
    if BLOCK_K >= 64:
        j = tl.arange(0, BLOCK_K // 64)
    else:
        j = tl.arange(0, 1)
    first = tl.cast(k_start // 64, tl.int64)
    return offs_n.to(tl.int64)[:, None] * n_blocks + (first + j)[None, :]


@triton.jit
def _broadcast_blocks(s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K // 64] per-block values → [BLOCK_N, BLOCK_K] per element."""
    s3 = tl.broadcast_to(s[:, :, None], (BLOCK_N, BLOCK_K // 64, 64))
    return tl.reshape(s3, (BLOCK_N, BLOCK_K))


@triton.jit
def _round_half_up(y):
    """Exact round-half-up of y to an integer-valued fp32 (no add after a multiply)."""
    f = tl.floor(y)
    return tl.where(y >= f + 0.5, f + 1.0, f)


@triton.jit
def _sqrt_code(t):
    """UINT8_SQRT code of t = x / scale in [0, 1 + 2**-23]: the number of thresholds
    theta_k = ((k - 0.5) * R255)**2 (fp32, k = 1..255) that t reaches, as int32.

    That is round-half-up of 255 * sqrt(t) with the half-way points taken in fp32,
    computed without an IEEE square root: q0 = trunc(255 * sqrt(t) + 0.25) from the
    approximate root is q or q - 1 (the root's error is ~1e-4 codes, far inside the
    0.25 margin), and one exact comparison with theta_{q0 + 1} settles it. So the code
    depends on t and the thresholds only, not on how the root was approximated: the
    interpreter's exact root and the GPU's `sqrt.approx` give the same codes.
    """
    q0 = tl.minimum((tl.sqrt(t) * 255.0 + 0.25).to(tl.int32), 254)
    c = (q0.to(tl.float32) + 0.5) * 0.003921568859368563  # R255; (k - 0.5) for k = q0 + 1
    return q0 + (t >= c * c).to(tl.int32)


@triton.jit
def _int4_code(y):
    """INT4 code of y = x / scale in [-1 - 2**-23, 1 + 2**-23]: the number of the 15 fp32 midpoints mu_1..mu_15
    (`forge_dsl.kernels.layouts.INT4_THRESHOLDS`) that y reaches (the nearest `INT4_MAP` value, ties up), as int32 in
    [0, 15]: what the 15 comparisons `y >= mu_k` count, for any fp32 y (7 for ±0, 15 for +inf, 0 for -inf, NaN).

    4 integer comparisons instead of 15. The midpoints are symmetric, mu_k = -mu_(15-k) for k <= 7, so y >= 0
    reaches 7 + #{k >= 8 : mu_k <= y} and y < 0 reaches 7 - #{k in 8..14 : mu_k < |y|}. On the magnitude's bits,
    which order like its values, mu_k < |y| is bits(mu_k) <= bits(|y|) - 1: one key counts for both signs (NaN as
    a negative beyond every midpoint), by a binary search of mu_8..mu_14 and one comparison with mu_15.
    """
    bits = y.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    below = (bits < 0) | (mag > 0x7F800000)  # negative, or NaN
    key = mag - below.to(tl.int32)
    # bits of mu_8..mu_15: 0x3B343958 0x3C9BA5E3 0x3D6147AE 0x3E147AE2 0x3EA66666 0x3F0CCCCD 0x3F466666 0x3F71999A
    b4 = key >= 0x3E147AE2  # mu_11
    b2 = key >= tl.where(b4, 0x3F0CCCCD, 0x3C9BA5E3)  # mu_13, mu_9
    b1 = key >= tl.where(b4, tl.where(b2, 0x3F466666, 0x3EA66666), tl.where(b2, 0x3D6147AE, 0x3B343958))
    c = b4.to(tl.int32) * 4 + b2.to(tl.int32) * 2 + b1.to(tl.int32)  # [0, 7]: how many of mu_8..mu_14 key passes
    return tl.where(below, 7 - c, 7 + c + (key >= 0x3F71999A).to(tl.int32))  # mu_15: non-negative y only


@triton.jit
def _int4_value(raw):
    """`forge_dsl.kernels.layouts.INT4_MAP[q]` (fp32, bit for bit) for INT4 codes q in [0, 15] (any int type). The map is
    symmetric about code 7 (p_(7-a) = -p_(7+a) for a <= 7; p_7 = +0, p_15 = 1), so the magnitude is picked by
    a = |q - 7| (a tree of selects on its bits, 8 instead of 15 selects) and the sign bit of q - 7 is ORed in."""
    d = raw.to(tl.int32) - 7  # [-7, 8]
    a = tl.abs(d)
    odd = (a & 1) != 0
    low = tl.where((a & 2) != 0, tl.where(odd, 0.07750000059604645, 0.032499998807907104),
                   tl.where(odd, 0.005499999970197678, 0.0))  # a in [0, 3]
    high = tl.where((a & 2) != 0, tl.where(odd, 0.887499988079071, 0.6625000238418579),
                    tl.where(odd, 0.4375, 0.21250000596046448))  # a in [4, 7]
    m = tl.where(a == 8, 1.0, tl.where((a & 4) != 0, high, low))
    return (m.to(tl.int32, bitcast=True) | (d & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def _store_pairs(ptr, codes, offs, mask, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Store 4-bit codes [BLOCK_N, BLOCK_K] (int32 in [0, 15]) two a byte: each even/odd neighbour pair of the
    tile (offsets offs, offs + 1, an even offs) as one byte at offs >> 1, the even one in the low nibble, where
    the even element is unmasked (rows have an even number of columns, so a pair is in or out as a whole)."""
    HALF: tl.constexpr = BLOCK_K // 2
    lo, hi = tl.split(tl.reshape(codes, (BLOCK_N, HALF, 2)))  # [BN, BK // 2] each
    o_lo, o_hi = tl.split(tl.reshape(offs, (BLOCK_N, HALF, 2)))
    m_lo, m_hi = tl.split(tl.reshape(mask.to(tl.int32), (BLOCK_N, HALF, 2)))
    byte = (lo | (hi << 4)).to(tl.uint8)
    if ptr.dtype.element_ty == tl.int8:
        byte = byte.to(tl.int8, bitcast=True)
    tl.store(ptr + (o_lo >> 1), byte, mask=m_lo != 0)


@triton.jit
def _word_offsets(offs, mask, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The 32-bit words of a 4-bit tile with NIBBLE_WORDS: (offsets [BLOCK_N, BLOCK_K // 8] int32, in words, and
    mask [BLOCK_N, BLOCK_K // 8]); word j of a tile row holds its columns 8j..8j+7, and is masked or not as a whole
    (rows of a multiple of 8 columns). Reduced over each word's 8 elements, as `_block_mask` over a block's 64, so
    these layouts are the other state helpers' (Gluon combines only tensors of one layout). One int32 reduction,
    the mask folded in as -1 (`kernel_calls.nibble_words` keeps word offsets below 2**31): it costs shuffles where
    the compiler spreads a word over threads, as it may in the Triton kernels."""
    o = tl.where(mask, (offs >> 3).to(tl.int32), -1)
    o_word = tl.max(tl.reshape(o, (BLOCK_N, BLOCK_K // 8, 8)), axis=2)
    return o_word, o_word >= 0


@triton.jit
def _nibble_shifts(x3):
    """4 × each element's index along the last axis (of 8) of the int tensor x3: where nibble e of a word starts.
    A scan of ones, not an arange: Gluon's arange needs a layout, which these shared helpers cannot name; the
    compiler folds it to constants where a thread holds whole words."""
    return (tl.cumsum(x3 * 0 + 1, axis=2) - 1) * 4


@triton.jit
def _unpack_words(words, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K // 8] int32 words of 8 codes → [BLOCK_N, BLOCK_K] codes (int32 in [0, 15]): element e of a
    word in bits 4e..4e+3. Broadcast over a last axis of 8, as `_broadcast_blocks` over 64, so the result has the
    tile's layout."""
    w3 = tl.broadcast_to(words[:, :, None], (BLOCK_N, BLOCK_K // 8, 8))
    return tl.reshape((w3 >> _nibble_shifts(w3)) & 0xF, (BLOCK_N, BLOCK_K))


@triton.jit
def _pack_words(codes, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K] codes (int32 in [0, 15]) → [BLOCK_N, BLOCK_K // 8] int32 words (`_unpack_words`'s
    inverse), in the layout of `_word_offsets`' (the same reduction)."""
    q = tl.reshape(codes, (BLOCK_N, BLOCK_K // 8, 8))
    return tl.sum(q << _nibble_shifts(q), axis=2)  # the nibbles' bits are disjoint: the sum is their OR


@triton.jit
def _load_codes(ptr, offs, mask, NIBBLE_WORDS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Load the 4-bit codes of a tile (masked ones read 0): NIBBLE_WORDS, the [BLOCK_N, BLOCK_K // 8] int32 words
    that hold them (`_unpack_words` takes them apart); else [BLOCK_N, BLOCK_K] uint8 codes, each shifted out of its
    own byte."""
    if NIBBLE_WORDS:
        o_word, m_word = _word_offsets(offs, mask, BLOCK_N, BLOCK_K)
        return tl.load(ptr.to(tl.pointer_type(tl.int32), bitcast=True) + o_word, mask=m_word, other=0)
    else:
        b = tl.load(ptr + (offs >> 1), mask=mask, other=0)  # [BN, BK]: each element's byte
        shift = ((offs & 1) * 4).to(tl.int32)  # the high nibble for an odd element
        return ((b.to(tl.uint8, bitcast=True).to(tl.int32) >> shift) & 0xF).to(tl.uint8)


@triton.jit
def _store_codes(ptr, codes, offs, mask, NIBBLE_WORDS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Store 4-bit codes [BLOCK_N, BLOCK_K] (int32 in [0, 15]): one 32-bit word per 8 (NIBBLE_WORDS), else one byte
    per pair (`_store_pairs`)."""
    if NIBBLE_WORDS:
        o_word, m_word = _word_offsets(offs, mask, BLOCK_N, BLOCK_K)
        tl.store(ptr.to(tl.pointer_type(tl.int32), bitcast=True) + o_word, _pack_words(codes, BLOCK_N, BLOCK_K),
                 mask=m_word)
    else:
        _store_pairs(ptr, codes, offs, mask, BLOCK_N, BLOCK_K)


@triton.jit
def load_state_raw(ptr, scale_ptr, offs, mask, scale_offs,
                   LAYOUT: tl.constexpr, NIBBLE_WORDS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Issue the loads of a state tile in its storage type; `decode_state` them later.

    Returns (codes [BLOCK_N, BLOCK_K], scales [BLOCK_N, BLOCK_K // 64] fp32, bf16 ones converted) for the quantized
    layouts (4-bit: each element's code as uint8, shifted out of its byte; with NIBBLE_WORDS the words
    [BLOCK_N, BLOCK_K // 8] int32 of 8 codes each instead), and (storage tile, the same tile again, unused)
    for FP32 and BF16. Arguments as for `load_state`.
    """
    if LAYOUT == 0:
        raw = tl.load(ptr + offs, mask=mask, other=0.0)
        return raw, raw
    elif LAYOUT == 1:
        tl.static_assert(ptr.dtype.element_ty == tl.int16, "bf16 state must be passed as t.view(torch.int16)")
        raw = tl.load(ptr + offs, mask=mask, other=0)
        return raw, raw
    else:
        tl.static_assert(BLOCK_K % 64 == 0, "BLOCK_K must be a multiple of 64")
        tl.static_assert(LAYOUT >= 2 and LAYOUT <= 5, "unknown state layout")
        bmask = _block_mask(mask, BLOCK_N, BLOCK_K)
        if scale_ptr.dtype.element_ty == tl.int16:  # bf16 scales (their bits): exact in fp32
            scale = bf16_bits_to_fp32(tl.load(scale_ptr + scale_offs, mask=bmask, other=0))
        else:
            tl.static_assert(scale_ptr.dtype.element_ty == tl.float32,
                             "block scales must be float32, or bfloat16 passed as t.view(torch.int16)")
            scale = tl.load(scale_ptr + scale_offs, mask=bmask, other=0.0)
        if LAYOUT >= 4:
            codes = _load_codes(ptr, offs, mask, NIBBLE_WORDS, BLOCK_N, BLOCK_K)
        else:
            codes = tl.load(ptr + offs, mask=mask, other=0)
        return codes, scale


@triton.jit
def decode_state(raw, scale, LAYOUT: tl.constexpr, NIBBLE_WORDS: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """The (raw, scale) pair of `load_state_raw` as an fp32 [BLOCK_N, BLOCK_K] tile."""
    if LAYOUT >= 4 and NIBBLE_WORDS:
        raw = _unpack_words(raw, BLOCK_N, BLOCK_K)
    if LAYOUT == 0:
        return raw.to(tl.float32)
    elif LAYOUT == 1:
        return bf16_bits_to_fp32(raw)
    else:
        qf = raw.to(tl.float32)
        if LAYOUT == 2:
            tl.static_assert(raw.dtype == tl.int8, "INT8 state must be int8")
            step = tl.div_rn(scale, 127.0)
            return qf * _broadcast_blocks(step, BLOCK_N, BLOCK_K)
        elif LAYOUT == 3:
            tl.static_assert(raw.dtype == tl.uint8, "UINT8_SQRT state must be uint8")
            r = qf * 0.003921568859368563  # R255
            return (_broadcast_blocks(scale, BLOCK_N, BLOCK_K) * r) * r
        elif LAYOUT == 4:
            return _broadcast_blocks(scale, BLOCK_N, BLOCK_K) * _int4_value(raw)
        else:
            tl.static_assert(LAYOUT == 5, "unknown state layout")
            return _broadcast_blocks(scale, BLOCK_N, BLOCK_K) * ((qf + 1.0) * 0.0625)  # (q + 1) / 16, exact


@triton.jit
def load_state(ptr, scale_ptr, offs, mask, scale_offs,
               LAYOUT: tl.constexpr, NIBBLE_WORDS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Load a state tile as fp32 (masked elements read 0).

    Args:
        ptr: the storage (fp32; int16 view of bf16; int8; uint8; int8 / uint8 bytes of two 4-bit codes, by LAYOUT).
        scale_ptr: the block scales `[rows, n_blocks]` (quantized layouts only; pass any pointer, e.g. the
            storage, otherwise): fp32, or bf16 as its int16 view. The pointer's element type picks the
            format at compile time (`forge_dsl.kernels.layouts.SCALE_DTYPES`).
        offs, mask: from `tile_offsets`.
        scale_offs: [BLOCK_N, BLOCK_K // 64] offsets of the tile's block scales in scale_ptr
            (`block_scale_offsets`; read by the int8 layouts only). BLOCK_K is a multiple of 64.
        NIBBLE_WORDS: INT4 / UINT4 codes are accessed a 32-bit word (8 codes) at a time, not a byte: only
            where every row of the packed storage starts on a 4-byte boundary, i.e. the tensor's columns are
            a multiple of 8 and `ptr` is 4-byte aligned (`kernel_calls.nibble_words` decides it for the kernels).
            The other layouts ignore it.
    """
    raw, scale = load_state_raw(ptr, scale_ptr, offs, mask, scale_offs, LAYOUT, NIBBLE_WORDS, BLOCK_N, BLOCK_K)
    return decode_state(raw, scale, LAYOUT, NIBBLE_WORDS, BLOCK_N, BLOCK_K)


@triton.jit
def store_state(ptr, scale_ptr, value, offs, mask, scale_offs,
                LAYOUT: tl.constexpr, NIBBLE_WORDS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Store an fp32 state tile in LAYOUT (arguments as for `load_state`).

    INT8 / UINT8_SQRT / INT4 / UINT4: each block's scale is computed from the NEW values
    (masked elements excluded), the codes and the `[BLOCK_N, BLOCK_K // 64]` scales are
    written (scales at scale_ptr + scale_offs, only for blocks holding an unmasked
    element; 4-bit codes two a byte, `_store_codes`). BF16 rounds to nearest even.
    bf16 scales (an int16 `scale_ptr`) hold the block maximum rounded UP to a bf16 (saturating at the
    largest finite one), and the codes are computed against that rounded scale.
    """
    if LAYOUT == 0:
        tl.store(ptr + offs, value.to(tl.float32), mask=mask)
    elif LAYOUT == 1:
        tl.static_assert(ptr.dtype.element_ty == tl.int16, "bf16 state must be passed as t.view(torch.int16)")
        tl.store(ptr + offs, fp32_to_bf16_bits_rne(value), mask=mask)
    else:
        tl.static_assert(BLOCK_K % 64 == 0, "BLOCK_K must be a multiple of 64")
        NB: tl.constexpr = BLOCK_K // 64
        x = value.to(tl.float32)
        # all on integer bits, so no compiler rewrite can change a NaN or a zero's sign
        bits = x.to(tl.int32, bitcast=True)
        mag = bits & 0x7FFFFFFF  # |x| (NaN of either sign: > 0x7F800000)
        if LAYOUT == 3 or LAYOUT == 5:
            # negatives and -0 → +0; NaN (either sign) stays NaN
            mag = tl.where(bits < 0, tl.where(mag > 0x7F800000, mag, 0), mag)
            x = mag.to(tl.float32, bitcast=True)
        # block max on the bit patterns (NaN above inf); masked elements count 0
        amax = tl.max(tl.reshape(tl.where(mask, mag, 0), (BLOCK_N, NB, 64)), axis=2)
        if LAYOUT >= 4:
            amax = tl.where(amax >= 0x7F800000, 0x7FC00000, amax)  # inf or NaN: the one NaN pattern
        else:
            amax = tl.where(amax > 0x7F800000, 0x7FC00000, amax)  # one NaN pattern for the scale
        if scale_ptr.dtype.element_ty == tl.int16:
            # bf16 scale bits: the high half, + 1 where the low half is nonzero; finite maxima saturate at
            # 0x7F7F (the largest finite bf16), inf stays 0x7F80 and NaN 0x7FC0 (`layouts.bf16_round_up_bits`)
            up = (amax >> 16) + ((amax & 0xFFFF) != 0).to(tl.int32)
            up = tl.where(amax < 0x7F800000, tl.minimum(up, 0x7F7F), up)  # [BLOCK_N, NB] in [0, 0x7FC0]
            scale = (up << 16).to(tl.float32, bitcast=True)
            stored = up.to(tl.int16)
        else:
            tl.static_assert(scale_ptr.dtype.element_ty == tl.float32,
                             "block scales must be float32, or bfloat16 passed as t.view(torch.int16)")
            scale = amax.to(tl.float32, bitcast=True)  # [BLOCK_N, NB]
            stored = scale
        ok = (scale > 0.0) & (scale <= 3.4028234663852886e38)  # finite and > 0 (NaN fails both)
        safe = tl.where(ok, scale, 1.0)
        # INT8: y = x * (127 / scale); UINT4: u = x * (16 / scale); UINT8_SQRT, INT4: x * (1 / scale).
        # One division per block.
        inv = tl.div_rn(127.0 if LAYOUT == 2 else (16.0 if LAYOUT == 5 else 1.0), safe)
        ok = ok & (inv <= 3.4028234663852886e38)  # a tiny scale's reciprocal overflows: codes 0
        inv = tl.where(ok, inv, 0.0)
        y = tl.where(_broadcast_blocks(ok, BLOCK_N, BLOCK_K), x, 0.0) * _broadcast_blocks(inv, BLOCK_N, BLOCK_K)
        if LAYOUT == 2:
            tl.static_assert(ptr.dtype.element_ty == tl.int8, "INT8 state must be int8")
            # |y| <= 127 * (1 + 2**-24)**2 < 127.5 (and < 127.5 for a saturated bf16 scale); the clamp guards
            codes = tl.minimum(tl.maximum(_round_half_up(y).to(tl.int32), -127), 127).to(tl.int8)
            tl.store(ptr + offs, codes, mask=mask)
        elif LAYOUT == 3:
            tl.static_assert(ptr.dtype.element_ty == tl.uint8, "UINT8_SQRT state must be uint8")
            codes = _sqrt_code(y).to(tl.uint8)  # y in [0, 1 + 2**-23]
            tl.store(ptr + offs, codes, mask=mask)
        elif LAYOUT == 4:
            tl.static_assert(ptr.dtype.element_ty == tl.int8, "INT4 state must be int8 bytes")
            _store_codes(ptr, _int4_code(y), offs, mask, NIBBLE_WORDS, BLOCK_N, BLOCK_K)  # invalid blocks: y = 0, 7
        else:
            tl.static_assert(LAYOUT == 5, "unknown state layout")
            tl.static_assert(ptr.dtype.element_ty == tl.uint8, "UINT4 state must be uint8 bytes")
            # u in [0, 16 (1 + 2**-23)**2] (below 16.07 for a saturated bf16 scale): the nearest of 1..16
            # (ties up), minus 1; the upper clamp guards
            q = tl.minimum(tl.maximum(_round_half_up(y).to(tl.int32), 1), 16) - 1
            _store_codes(ptr, q, offs, mask, NIBBLE_WORDS, BLOCK_N, BLOCK_K)
        bmask = _block_mask(mask, BLOCK_N, BLOCK_K)
        tl.store(scale_ptr + scale_offs, stored, mask=bmask)
