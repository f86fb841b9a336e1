"""The Triton kernel of the fused embedding's backward (`forge_dsl.training.embedding`), imported on first launch.

    rows_grad[(R, cdiv(D, BLOCK_D))](GRAD, ORDER, OFFSETS, BLOCK, r0, D, stride_grad, stride_block, ...)
        BLOCK [R, D] fp32 = the gradient of embedding rows [r0, r0 + R): row r sums, in fp32, the rows of
        GRAD [T, D] of its tokens ORDER[OFFSETS[r0 + r] : OFFSETS[r0 + r + 1]]; a row without tokens is 0.

ORDER is the token positions sorted by id (stable), OFFSETS [V + 1] where each id's run starts in it. Each
program owns one row and BLOCK_D columns and adds its tokens BLOCK_T at a time, in token order (a fixed tree
inside each chunk), so the sum is deterministic: the same bits every run for the same ids and config.
"""

import triton
import triton.language as tl

__all__ = ["rows_grad"]


@triton.jit
def rows_grad(GRAD, ORDER, OFFSETS, BLOCK, r0, D, stride_grad, stride_block,
              SCALE_BY_FREQ: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    # -- program id -> (row of the tile, columns) --------------------------------------------------------
    row = tl.program_id(0)
    o_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BD]
    m_d = o_d < D
    start = tl.load(OFFSETS + r0 + row)
    end = tl.load(OFFSETS + r0 + row + 1)
    # -- the row's tokens, BLOCK_T at a time -----------------------------------------------------------
    b_acc = tl.zeros([BLOCK_D], dtype=tl.float32)  # [BD]
    for t0 in range(start, end, BLOCK_T):
        o_t = t0 + tl.arange(0, BLOCK_T)  # [BT]
        m_t = o_t < end
        o_tok = tl.load(ORDER + o_t, mask=m_t, other=0).to(tl.int64)  # [BT]
        p_g = GRAD + o_tok[:, None] * stride_grad + o_d[None, :]  # [BT, BD]
        b_g = tl.load(p_g, mask=m_t[:, None] & m_d[None, :], other=0.0).to(tl.float32)  # [BT, BD]
        b_acc += tl.sum(b_g, axis=0)
    if SCALE_BY_FREQ:  # torch's scale_grad_by_freq: the row's sum over its count in the batch
        b_acc = b_acc / tl.maximum(end - start, 1).to(tl.float32)
    # -- store the row (zeros where it has no tokens) --------------------------------------------------
    tl.store(BLOCK + row.to(tl.int64) * stride_block + o_d, b_acc, mask=m_d)
