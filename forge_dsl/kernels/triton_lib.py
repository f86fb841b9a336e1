"""Triton helpers that generated optimizer kernels call to load and store weights and state.

Every helper works on a 2-D register tile `[BLOCK_N, BLOCK_K]` of a row-major,
contiguous 2-D tensor with `n_cols` columns (see `forge_dsl.layouts.as_rows`).
`BLOCK_K` is a multiple of 64 and tiles start at column multiples of `BLOCK_K`,
so an int8 block (64 consecutive elements of a row) never straddles two tiles.

The layouts and formulas are those of `forge_dsl.layouts` (read its docstring):
the helpers follow them operation for operation, in fp32, so the Triton
interpreter, the compiled kernel and the torch reference agree bit for bit.
What makes that hold:

* bf16 is read and written as int16 bit patterns (pass `t.view(torch.int16)`):
  the interpreter truncates fp32 → bf16 while the GPU rounds, so the
  interpreter rounds here on integer bits and the compiled kernel uses the
  hardware conversion, which gives the same bits (`COMPILED` switches);
  stochastic rounding is integer arithmetic on both.
* divisions use `tl.div_rn` (IEEE; plain `/` is approximate on NVIDIA GPUs); the
  one square root (`_sqrt_code`) is approximate and then corrected by an exact
  comparison, so its result does not depend on the root's rounding.
* no product feeds an addition inside a helper (the GPU compiler would fuse
  them into one FMA and round once instead of twice); rounding to an integer
  compares `y >= floor(y) + 0.5` instead of computing `floor(y + 0.5)`.
* block maxima are integer maxima of fp32 bit patterns (order-independent,
  NaN-propagating the same way on every backend).

What the CALLER must know for bit-exact interpreter/GPU agreement: a value
returned by `load_state` (a product `q * step`, or `(scale * r) * r`) that
the kernel then adds to something can be contracted into an FMA by the GPU
compiler; so can any `a * b + c` in the optimizer math itself. Launch the
kernel with `enable_fp_fusion=False` when results must match the interpreter
bit for bit.

Layout codes are the plain ints of `forge_dsl.layouts.StateLayout`:
0 = FP32, 1 = BF16, 2 = INT8, 3 = UINT8_SQRT, 4 = INT4, 5 = UINT4.

The 4-bit layouts hold two codes a byte (element `offs` in byte `offs >> 1`, the low nibble for an
even `offs`): that is the packed `[rows, cols / 2]` storage only because every row has an even number
of columns (`forge_dsl.layouts.resolve_layout` keeps odd ones fp32) and tiles start at even columns.
With NIBBLE_WORDS (rows of a multiple of 8 columns in storage that starts on a 4-byte boundary:
`launches.nibble_words`) the 8 elements of a row from each column multiple of 8 on share one
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
from triton.runtime.jit import JITFunction

# Layout codes, equal to forge_dsl.layouts.StateLayout. Module-level constants
# must be `tl.constexpr(...)` objects for jit code to read them (the interpreter
# accepts plain globals, the compiler does not).
LAYOUT_FP32 = tl.constexpr(0)
LAYOUT_BF16 = tl.constexpr(1)
LAYOUT_INT8 = tl.constexpr(2)
LAYOUT_UINT8_SQRT = tl.constexpr(3)
LAYOUT_INT4 = tl.constexpr(4)
LAYOUT_UINT4 = tl.constexpr(5)

QBLOCK = tl.constexpr(64)  # forge_dsl.layouts.BLOCK
# fp32(1/255), the exact constant forge_dsl.layouts.R255.
# (The jit code spells these three as literals: the 3.9 interpreter cannot do
# `int % constexpr`, and literals behave the same everywhere.)
R255 = tl.constexpr(0.003921568859368563)
FLT_MAX = tl.constexpr(3.4028234663852886e38)

# How `store_weight` writes a bf16 weight: its STOCHASTIC argument (`launches.rounding_code` picks it).
ROUND_NEAREST = tl.constexpr(0)
ROUND_STOCHASTIC = tl.constexpr(1)  # any tile
ROUND_STOCHASTIC_PAIRS = tl.constexpr(2)  # one hash per two elements; needs an even number of columns


__all__ = [
    "ROUND_NEAREST",
    "ROUND_STOCHASTIC",
    "ROUND_STOCHASTIC_PAIRS",
    "random_bits",
    "random16",
    "accumulate_dw",
    "accumulate_dw_halves",
    "split_columns",
    "grouped_tile",
    "load_tokens",
    "tile_at",
    "tile_offsets",
    "block_scale_offsets",
    "bf16_bits_to_fp32",
    "fp32_to_bf16_bits_rne",
    "fp32_to_bf16_bits_stochastic",
    "load_weight",
    "load_weight_raw",
    "decode_weight",
    "store_weight",
    "load_state",
    "load_state_raw",
    "decode_state",
    "store_state",
    "math_atan",
    "math_atan2",
    "math_erf",
    "math_expm1",
    "math_log1p",
    "math_pow",
    "math_tanh",
]


@triton.jit
def tile_offsets(offs_n, offs_k, n_rows, n_cols):
    """Element offsets and in-bounds mask of a tile.

    Args:
        offs_n: [BLOCK_N] row indices; offs_k: [BLOCK_K] column indices.
    Returns:
        (offs, mask): offs [BLOCK_N, BLOCK_K] int64 = row * n_cols + col;
        mask [BLOCK_N, BLOCK_K] = (row < n_rows) & (col < n_cols).
    """
    rows = offs_n.to(tl.int64)[:, None]
    cols = offs_k.to(tl.int64)[None, :]
    offs = rows * n_cols + cols
    mask = (rows < n_rows) & (cols < n_cols)
    return offs, mask


# ---------------------------------------------------------------------------
# bf16 on integer bits
# ---------------------------------------------------------------------------


@triton.jit
def bf16_bits_to_fp32(bits):
    """int16 bf16 bit patterns → fp32 (exact)."""
    w = bits.to(tl.uint16, bitcast=True).to(tl.uint32) << 16
    return w.to(tl.float32, bitcast=True)


# Whether this module's jit functions run compiled (True) or in the Triton interpreter (False).
# Triton decides that when it decorates them (TRITON_INTERPRET at import), so this is read from one of them.
COMPILED = tl.constexpr(isinstance(bf16_bits_to_fp32, JITFunction))


@triton.jit
def fp32_to_bf16_bits_rne(x):
    """fp32 → int16 bf16 bit patterns, round to nearest even; NaN → 0x7FFF, inf kept, subnormals kept.

    Compiled: the hardware conversion (`cvt.rn.bf16x2.f32`, one instruction per two elements; NaN
    gives the canonical 0x7FFF). Interpreted: the same result on integer bits, since the interpreter
    truncates. Both equal `forge_dsl.layouts.bf16_round_nearest_bits` bit for bit
    (tests/test_triton_lib.py, every rounding case and special value). The integer form costs about
    6 instructions per element, which made the two bf16 states of AdamW a sixth of the warp-specialized
    epilogue's instructions (docs/PERF.md v11b).
    """
    if COMPILED:
        return x.to(tl.float32).to(tl.bfloat16).to(tl.int16, bitcast=True)
    else:
        b = x.to(tl.float32).to(tl.uint32, bitcast=True)
        r = (b + (((b >> 16) & 1) + 0x7FFF)) >> 16
        r = tl.where(x != x, 0x7FFF, r)
        return r.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _hash32(x):
    """lowbias32 (C. Wellons, 2018): a uint32 → uint32 hash with near-ideal avalanche."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


@triton.jit
def random_bits(idx, seed):
    """32 random bits for each index `idx` (any int tensor), a function of (seed mod 2**32, idx mod 2**32) only.

    One round of `_hash32` per index, on a Weyl step, idx * 0x9E3779B9 + key, where the key hashes
    the seed twice, once per program: 3 multiplies per index, against about 20 for `tl.randint`
    (Philox-4x32-10, which computes 4 words to use one; on the H200 it made the bf16 write-back cost
    more than the whole GEMM). Both maps are bijections of uint32, so distinct indices hash distinct
    inputs. The multiply matters: one round on idx ^ key leaves the bits of indices a power of two
    apart correlated (|z| up to 13 over 2**23 indices); the Weyl step spreads such differences over
    the high bits, and the result is as uncorrelated as two rounds, which cost 9 more instructions
    (docs/PERF.md v11a; `test_random_bits_uncorrelated_at_any_lag`). Integer arithmetic only, so the
    interpreter and the GPU draw the same bits.
    """
    # The low 32 bits of the seed only: Triton passes a seed in [2**31, 2**32) as uint32 when compiling
    # and as int32 in the interpreter, so any use of the high bits would differ between the two.
    lo = tl.cast(seed, tl.int64).to(tl.uint32)
    key = _hash32(_hash32(lo) + 0x9E3779B9)
    return _hash32(idx.to(tl.uint32) * 0x9E3779B9 + key)


@triton.jit
def random16(offs, seed):
    """16 random bits per element, as uint32 in [0, 65536): element e takes the low half (e even) or the
    high half (e odd) of `random_bits(e >> 1, seed)`, so two neighbours share one hash (v11c). A function
    of (seed mod 2**32, e mod 2**33) only, never of the tile shape."""
    h = random_bits(offs >> 1, seed)
    return (h >> ((offs & 1) * 16).to(tl.uint32)) & 0xFFFF


@triton.jit
def fp32_to_bf16_bits_stochastic(x, offs, seed, PAIRS: tl.constexpr):
    """fp32 → int16 bf16 bit patterns, stochastic rounding; NaN → 0x7FFF, inf kept.

    Adds 16 random bits to the fp32 pattern and truncates, so a value rounds up
    with probability (its low 16 bits) / 65536: unbiased. The random bits are
    `random16(offs, seed)`: a function of (seed, element index) only, never of
    the tile shape. x, offs: [BN, BK]. PAIRS: every row of the tile starts at an
    even element index (and BK is even); then each pair of neighbours hashes once,
    4.5 instructions per element fewer, the same bits.
    """
    b = x.to(tl.float32).to(tl.uint32, bitcast=True)
    if PAIRS:
        BN: tl.constexpr = x.shape[0]
        BK: tl.constexpr = x.shape[1]
        b_even, b_odd = tl.split(tl.reshape(b, [BN, BK // 2, 2]))  # [BN, BK // 2] each
        offs_even, offs_odd = tl.split(tl.reshape(offs, [BN, BK // 2, 2]))
        h = random_bits(offs_even >> 1, seed)
        r = tl.reshape(tl.join((b_even + (h & 0xFFFF)) >> 16, (b_odd + (h >> 16)) >> 16), [BN, BK])
    else:
        r = (b + random16(offs, seed)) >> 16
    r = tl.where(x != x, 0x7FFF, r)
    return r.to(tl.uint16).to(tl.int16, bitcast=True)


# ---------------------------------------------------------------------------
# the fused kernel's token loop
# ---------------------------------------------------------------------------


@triton.jit
def grouped_tile(pid, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr):
    """Program id -> (pid_n, pid_k) of its [BLOCK_N, BLOCK_K] tile of W [N, K], in groups of GROUP_N
    tile rows, so that programs running together share columns of X in L2 (Triton tutorial 03)."""
    n_tiles_n = tl.cdiv(N, BLOCK_N)
    n_tiles_k = tl.cdiv(K, BLOCK_K)
    tiles_per_group = GROUP_N * n_tiles_k
    first_n = (pid // tiles_per_group) * GROUP_N
    group_size = min(n_tiles_n - first_n, GROUP_N)
    pid_n = first_n + (pid % tiles_per_group) % group_size
    pid_k = (pid % tiles_per_group) // group_size
    return pid_n, pid_k


@triton.jit
def tile_at(tile, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr):
    """Tile number `tile` (in [0, number of tiles)) of W [N, K] in grouped order:
    (offs_n [BLOCK_N] rows, offs_k [BLOCK_K] columns, n_start, k_start = its first row and column)."""
    pid_n, pid_k = grouped_tile(tile, N, K, BLOCK_N, BLOCK_K, GROUP_N)
    n_start = pid_n * BLOCK_N
    k_start = pid_k * BLOCK_K
    return n_start + tl.arange(0, BLOCK_N), k_start + tl.arange(0, BLOCK_K), n_start, k_start


@triton.jit
def load_tokens(A, t_start, c_start, n_rows, n_cols, stride_t, stride_c, TMA: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """The [BLOCK_T, BLOCK_C] block of an activation A [n_rows tokens, n_cols] at (t_start, c_start), 0 outside.

    TMA: A is a `TensorDescriptor` with that block shape (a Hopper TMA copy); otherwise a
    pointer with strides (stride_t, stride_c).
    """
    if TMA:
        return A.load([t_start, c_start])
    else:
        offs_t = t_start + tl.arange(0, BLOCK_T)
        offs_c = c_start + tl.arange(0, BLOCK_C)
        p = A + offs_t[:, None].to(tl.int64) * stride_t + offs_c[None, :].to(tl.int64) * stride_c
        return tl.load(p, mask=(offs_t[:, None] < n_rows) & (offs_c[None, :] < n_cols), other=0.0)


@triton.jit
def accumulate_dw(X, DY, n_start, k_start, T, N, K, stride_xt, stride_xk, stride_dyt, stride_dyn,
                  DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """dW[n_start:+BLOCK_N, k_start:+BLOCK_K] = DY[:, n-block]ᵀ · X[:, k-block] over all T tokens, in fp32 registers.

    X [T, K] and DY [T, N]: pointers with any strides, or TMA descriptors (TMA) with blocks
    [BLOCK_T, BLOCK_K] and [BLOCK_T, BLOCK_N]; ragged edges read 0. DOT_FP32 upcasts the
    operands (the interpreter's bf16 dot is wrong; fp32 activations are fp32 anyway);
    INPUT_PRECISION is "ieee", "tf32" or None (native bf16). Returns the [BLOCK_N, BLOCK_K] accumulator.
    """
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # [BN, BK]
    for t0 in range(0, T, BLOCK_T):
        b_x = load_tokens(X, t0, k_start, T, K, stride_xt, stride_xk, TMA, BLOCK_T, BLOCK_K)  # [BT, BK]
        b_dy = load_tokens(DY, t0, n_start, T, N, stride_dyt, stride_dyn, TMA, BLOCK_T, BLOCK_N)  # [BT, BN]
        if DOT_FP32:
            b_x = b_x.to(tl.float32)
            b_dy = b_dy.to(tl.float32)
        acc = tl.dot(tl.trans(b_dy), b_x, acc, input_precision=INPUT_PRECISION)
    return acc


@triton.jit
def accumulate_dw_halves(X, DY, n_start, k_start, T, N, K, stride_xt, stride_xk, stride_dyt, stride_dyn,
                         DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, HALF_K: tl.constexpr):
    """`accumulate_dw` for a [BLOCK_N, 2·HALF_K] tile, kept as its two column halves.

    Returns (acc0, acc1), each [BLOCK_N, HALF_K] fp32: columns k_start + [0, HALF_K) and
    k_start + [HALF_K, 2·HALF_K). The same products as `accumulate_dw` (one ΔY block, two dots),
    so an epilogue can run on one half while the other waits, needing half the registers of a
    whole-tile epilogue. With TMA, X's blocks are [BLOCK_T, HALF_K].
    """
    acc0 = tl.zeros((BLOCK_N, HALF_K), dtype=tl.float32)  # [BN, BK/2]
    acc1 = tl.zeros((BLOCK_N, HALF_K), dtype=tl.float32)  # [BN, BK/2]
    for t0 in range(0, T, BLOCK_T):
        b_dy = load_tokens(DY, t0, n_start, T, N, stride_dyt, stride_dyn, TMA, BLOCK_T, BLOCK_N)  # [BT, BN]
        b_x0 = load_tokens(X, t0, k_start, T, K, stride_xt, stride_xk, TMA, BLOCK_T, HALF_K)  # [BT, BK/2]
        b_x1 = load_tokens(X, t0, k_start + HALF_K, T, K, stride_xt, stride_xk, TMA, BLOCK_T, HALF_K)
        if DOT_FP32:
            b_x0 = b_x0.to(tl.float32)
            b_x1 = b_x1.to(tl.float32)
            b_dy = b_dy.to(tl.float32)
        b_dyt = tl.trans(b_dy)
        acc0 = tl.dot(b_dyt, b_x0, acc0, input_precision=INPUT_PRECISION)
        acc1 = tl.dot(b_dyt, b_x1, acc1, input_precision=INPUT_PRECISION)
    return acc0, acc1


@triton.jit
def split_columns(acc, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """An accumulator [BLOCK_N, BLOCK_K] → its left and right column halves, [BLOCK_N, BLOCK_K // 2] each.

    An epilogue can then work on one slice of a tile at a time. On sm_90 the split adds no shared
    memory traffic: a dot → split → store kernel compiles to the same shared-memory instructions as
    one storing the whole tile (each thread's columns of the MMA accumulator fall into both halves).
    """
    return tl.split(tl.permute(tl.reshape(acc, (BLOCK_N, 2, BLOCK_K // 2)), (0, 2, 1)))


# ---------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------


@triton.jit
def load_weight_raw(ptr, offs, mask, W_BF16: tl.constexpr):
    """Issue the load of a weight tile in its storage type (int16 bf16 bits, or fp32); `decode_weight` it later.

    Split from the decoding so a kernel can start the load early (before its token loop)
    and hold only the narrow storage in registers until the epilogue needs the values.
    """
    if W_BF16:
        tl.static_assert(ptr.dtype.element_ty == tl.int16, "bf16 weights must be passed as t.view(torch.int16)")
        return tl.load(ptr + offs, mask=mask, other=0)
    else:
        return tl.load(ptr + offs, mask=mask, other=0.0)


@triton.jit
def decode_weight(raw, W_BF16: tl.constexpr):
    """A tile from `load_weight_raw` as fp32."""
    if W_BF16:
        return bf16_bits_to_fp32(raw)
    else:
        return raw.to(tl.float32)


@triton.jit
def load_weight(ptr, offs, mask, W_BF16: tl.constexpr):
    """Load a weight tile as fp32 (masked elements read 0).

    W_BF16: the weight is bf16, and `ptr` points at its int16 view.
    """
    return decode_weight(load_weight_raw(ptr, offs, mask, W_BF16), W_BF16)


@triton.jit
def store_weight(ptr, value, offs, mask, seed, W_BF16: tl.constexpr, STOCHASTIC: tl.constexpr):
    """Store an fp32 weight tile.

    W_BF16: the weight is bf16 and `ptr` points at its int16 view; it is rounded as
    STOCHASTIC says (ignored for fp32): ROUND_NEAREST (0, or False) to nearest even,
    ROUND_STOCHASTIC (1, or True) stochastically, ROUND_STOCHASTIC_PAIRS (2) the same
    bits with one hash per two neighbours, where every tile row starts at an even
    element index (`launches.rounding_code` picks it from the number of columns).

    seed: a Python int in [0, 2**63), the key of `random_bits`. The
    caller mixes (user seed, step) into it; the random bits of element `offs`
    depend only on (seed, offs) (`random16`). Interpreter and GPU give the same
    bits for seeds 0, 1, 7, 2**31 - 1, 2**31 + 3, 2**40 + 12345 and 2**63 - 1
    (tests/test_triton_lib.py). Triton types an int argument by its value (i32
    below 2**31, then u32 / i64) and specializes values equal to 1 or divisible
    by 16, so a seed that changes every step should stay in one range (e.g.
    [0, 2**31)) and be listed in the kernel's `do_not_specialize`, or the kernel
    recompiles for some steps.
    """
    if W_BF16:
        tl.static_assert(ptr.dtype.element_ty == tl.int16, "bf16 weights must be passed as t.view(torch.int16)")
        if STOCHASTIC:
            bits = fp32_to_bf16_bits_stochastic(value, offs, seed, STOCHASTIC == 2)
        else:
            bits = fp32_to_bf16_bits_rne(value)
        tl.store(ptr + offs, bits, mask=mask)
    else:
        tl.store(ptr + offs, value.to(tl.float32), mask=mask)


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
    (`forge_dsl.layouts.INT4_THRESHOLDS`) that y reaches (the nearest `INT4_MAP` value, ties up), as int32 in
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
    """`forge_dsl.layouts.INT4_MAP[q]` (fp32, bit for bit) for INT4 codes q in [0, 15] (any int type). The map is
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
    the mask folded in as -1 (`launches.nibble_words` keeps word offsets below 2**31): it costs shuffles where
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
            format at compile time (`forge_dsl.layouts.SCALE_DTYPES`).
        offs, mask: from `tile_offsets`.
        scale_offs: [BLOCK_N, BLOCK_K // 64] offsets of the tile's block scales in scale_ptr
            (`block_scale_offsets`; read by the int8 layouts only). BLOCK_K is a multiple of 64.
        NIBBLE_WORDS: INT4 / UINT4 codes are accessed a 32-bit word (8 codes) at a time, not a byte: only
            where every row of the packed storage starts on a 4-byte boundary, i.e. the tensor's columns are
            a multiple of 8 and `ptr` is 4-byte aligned (`launches.nibble_words` decides it for the kernels).
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


# ----------------------------------------------------------------------------
# Math functions of the spec language that Triton lacks (or lacks in the interpreter)
# ----------------------------------------------------------------------------
# `triton.language.extra.libdevice` has these, but the interpreter cannot call it, so the kernels
# tested on the CPU would not be the kernels run on the GPU. These are written with operations both
# run: fp32 tiles in, fp32 tiles out, with the special values of torch / C99 (docs/LANGUAGE.md,
# "Numbers"). A two-argument helper also takes a scalar for either argument (a host kernel argument,
# which the interpreter passes as a Python float, or a literal) and broadcasts it first: the 3.9
# interpreter cannot `&` a scalar boolean with a tile. Divisions are `tl.div_rn` (IEEE)
# where a special value or a bound depends on the quotient, and a negation is `r * -1.0`: Triton
# compiles `-r` to `0.0 - r`, which is +0.0 for r = +0.0.


@triton.jit
def _sign_bit(x):
    """True where x's sign bit is set (negative numbers, -0.0, -inf, a negative NaN)."""
    return x.to(tl.int32, bitcast=True) < 0


@triton.jit
def _tiles(a, b):
    """a and b as fp32 tensors of one shape (either may be a scalar or a Python float)."""
    return tl.broadcast(tl.cast(a, tl.float32), tl.cast(b, tl.float32))


@triton.jit
def math_pow(x, y):
    """x ** y for any x, y (torch.pow): pow(x, 0) = 1 and pow(1, y) = 1, NaN included; pow(-1, +-inf)
    = 1; a negative finite base with a non-integer exponent is NaN, with an integer one it is
    |x| ** y with the sign of its parity (-0.0 and -inf included). |x| ** y is exp2(y * log2|x|):
    relative error about |y * log2|x|| * 1e-7."""
    x, y = _tiles(x, y)
    r = tl.exp2(y * tl.log2(tl.abs(x)))
    y_int = tl.floor(y) == y  # +-inf counts as an even integer; NaN as neither
    y_odd = y_int & (tl.floor(y * 0.5) * 2.0 != y)
    r = tl.where(_sign_bit(x) & y_odd, r * -1.0, r)
    r = tl.where((x < 0) & (x != float("-inf")) & (~y_int), float("nan"), r)
    r = tl.where((x == -1.0) & (tl.abs(y) == float("inf")), 1.0, r)
    return tl.where((y == 0) | (x == 1.0), 1.0, r)


@triton.jit
def _atan_unit(t):
    """atan(t) for t in [0, 1] (or NaN): t > tan(pi/8) is reduced by atan(t) = pi/4 + atan((t-1)/(t+1)),
    then Cephes' atanf polynomial on |u| <= tan(pi/8)."""
    big = t > 0.41421356237309503
    u = tl.where(big, tl.div_rn(t - 1.0, t + 1.0), t)
    z = u * u
    p = (((8.05374449538e-2 * z - 1.38776856032e-1) * z + 1.99777106478e-1) * z - 3.33329491539e-1) * z * u + u
    return tl.where(big, 0.7853981633974483 + p, p)


@triton.jit
def math_atan(x):
    """atan(x): odd, atan(+-inf) = +-pi/2, atan(-0.0) = -0.0, NaN for NaN."""
    a = tl.abs(x)
    inv = a > 1.0
    r = _atan_unit(tl.where(inv, tl.div_rn(1.0, a), a))
    r = tl.where(inv, 1.5707963267948966 - r, r)
    return tl.where(x < 0, r * -1.0, tl.where(x == 0, x, r))


@triton.jit
def math_atan2(y, x):
    """atan2(y, x) in [-pi, pi] with C99's special values: the signs of zeros count (atan2(+-0, -0)
    = +-pi), atan2(+-inf, +-inf) = +-pi/4 or +-3pi/4, NaN if either is NaN."""
    y, x = _tiles(y, x)
    ax = tl.abs(x)
    ay = tl.abs(y)
    hi = tl.maximum(ax, ay)
    lo = tl.minimum(ax, ay)
    t = tl.where(hi == 0, 0.0, tl.div_rn(lo, tl.where(hi == 0, 1.0, hi)))
    t = tl.where(lo == float("inf"), 1.0, t)
    r = _atan_unit(t)
    r = tl.where(ay > ax, 1.5707963267948966 - r, r)
    r = tl.where(_sign_bit(x), 3.141592653589793 - r, r)
    r = tl.where((x != x) | (y != y), float("nan"), r)
    return tl.where(_sign_bit(y), r * -1.0, r)


@triton.jit
def math_expm1(x):
    """exp(x) - 1 without cancellation near 0: the Taylor series to x**9 for |x| < 0.5 (truncation below
    1e-9 relative), exp(x) - 1 elsewhere; expm1(-0.0) = -0.0, -1 at -inf, inf on overflow."""
    p = x * (1.0 + x * (0.5 + x * (1.6666666666666666e-1 + x * (4.1666666666666664e-2 + x * (
        8.333333333333333e-3 + x * (1.388888888888889e-3 + x * (1.984126984126984e-4 + x * (
            2.48015873015873e-5 + x * 2.755731922398589e-6))))))))
    return tl.where(tl.abs(x) < 0.5, p, tl.exp(x) - 1.0)


@triton.jit
def math_log1p(x):
    """log(1 + x) without cancellation near 0: 2 atanh(s), s = x / (2 + x), by its odd series to s**11
    for x in (-0.25, 0.375) (|s| < 0.16, truncation below 1e-10 relative), log(1 + x) elsewhere;
    log1p(-0.0) = -0.0, -inf at -1, NaN below -1."""
    s = tl.div_rn(x, x + 2.0)
    z = s * s
    p = 2.0 * s * (1.0 + z * (3.3333333333333333e-1 + z * (0.2 + z * (1.4285714285714285e-1 + z * (
        1.1111111111111111e-1 + z * 9.090909090909091e-2)))))
    return tl.where((x > -0.25) & (x < 0.375), p, tl.log(1.0 + x))


@triton.jit
def math_tanh(x):
    """tanh(x) = e / (e + 2) with e = expm1(2|x|), |x| capped at 10 (tanh(10) is 1 in fp32), the sign
    restored; tanh(-0.0) = -0.0, +-1 at +-inf, NaN for NaN."""
    a = tl.abs(x)
    e = math_expm1(2.0 * tl.where(a > 10.0, 10.0, a))
    r = tl.div_rn(e, e + 2.0)
    return tl.where(x < 0, r * -1.0, tl.where(x == 0, x, r))


@triton.jit
def math_erf(x):
    """erf(x) (Triton's; libdevice's erff when compiled)."""
    return tl.erf(x)
