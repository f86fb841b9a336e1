"""Triton helpers of the fused and element-wise kernels: tiles, the token loop, bf16 and weights.

Every helper works on a 2-D register tile `[BLOCK_N, BLOCK_K]` of a row-major,
contiguous 2-D tensor with `n_cols` columns (see `forge_dsl.kernels.layouts.as_rows`).
`BLOCK_K` is a multiple of 64 and tiles start at column multiples of `BLOCK_K`,
so an int8 block (64 consecutive elements of a row) never straddles two tiles.

The layouts and formulas are those of `forge_dsl.kernels.layouts` (read its docstring):
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

The state layouts are read and written by `state_lib`; the spec language's math functions that
Triton lacks are `math_lib`.
"""

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

# How `store_weight` writes a bf16 weight: its STOCHASTIC argument (`kernel_calls.rounding_code` picks it).
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
    "bf16_bits_to_fp32",
    "fp32_to_bf16_bits_rne",
    "fp32_to_bf16_bits_stochastic",
    "load_weight",
    "load_weight_raw",
    "decode_weight",
    "weight_bits",
    "stored_weight",
    "store_weight",
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
    truncates. Both equal `forge_dsl.kernels.layouts.bf16_round_nearest_bits` bit for bit
    (tests/kernels/test_kernel_libs.py, every rounding case and special value). The integer form costs about
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
def weight_bits(value, offs, seed, STOCHASTIC: tl.constexpr):
    """The int16 bf16 bits a bf16 weight tile `value` [BN, BK] fp32 at element offsets `offs` is written as:
    the one home of the weight's rounding, which `store_weight` stores and `stored_weight` reads back.
    STOCHASTIC and seed as for `store_weight`."""
    if STOCHASTIC:
        return fp32_to_bf16_bits_stochastic(value, offs, seed, STOCHASTIC == 2)
    else:
        return fp32_to_bf16_bits_rne(value)


@triton.jit
def stored_weight(value, offs, seed, W_BF16: tl.constexpr, STOCHASTIC: tl.constexpr):
    """The fp32 value `store_weight(ptr, value, offs, mask, seed, W_BF16, STOCHASTIC)` writes, without writing
    it: a bf16 weight's rounding (`weight_bits`: the same bits, stochastic ones included), an fp32 weight's
    value itself. The spec language's `stored(x)` (docs/LANGUAGE.md §8); value, offs: [BN, BK]."""
    if W_BF16:
        return bf16_bits_to_fp32(weight_bits(value, offs, seed, STOCHASTIC))
    else:
        return value.to(tl.float32)


@triton.jit
def store_weight(ptr, value, offs, mask, seed, W_BF16: tl.constexpr, STOCHASTIC: tl.constexpr):
    """Store an fp32 weight tile.

    W_BF16: the weight is bf16 and `ptr` points at its int16 view; it is rounded as
    STOCHASTIC says (ignored for fp32; `weight_bits`): ROUND_NEAREST (0, or False) to nearest even,
    ROUND_STOCHASTIC (1, or True) stochastically, ROUND_STOCHASTIC_PAIRS (2) the same
    bits with one hash per two neighbours, where every tile row starts at an even
    element index (`kernel_calls.rounding_code` picks it from the number of columns).

    seed: a Python int in [0, 2**63), the key of `random_bits`. The
    caller mixes (user seed, step) into it; the random bits of element `offs`
    depend only on (seed, offs) (`random16`). Interpreter and GPU give the same
    bits for seeds 0, 1, 7, 2**31 - 1, 2**31 + 3, 2**40 + 12345 and 2**63 - 1
    (tests/kernels/test_kernel_libs.py). Triton types an int argument by its value (i32
    below 2**31, then u32 / i64) and specializes values equal to 1 or divisible
    by 16, so a seed that changes every step should stay in one range (e.g.
    [0, 2**31)) and be listed in the kernel's `do_not_specialize`, or the kernel
    recompiles for some steps.
    """
    if W_BF16:
        tl.static_assert(ptr.dtype.element_ty == tl.int16, "bf16 weights must be passed as t.view(torch.int16)")
        tl.store(ptr + offs, weight_bits(value, offs, seed, STOCHASTIC), mask=mask)
    else:
        tl.store(ptr + offs, value.to(tl.float32), mask=mask)
