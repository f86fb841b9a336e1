"""dW = dyᵀ x of one linear layer one slab of rows at a time, as autograd rounds it, never whole.

    for r0, slab in slab_grads(x2, dy2, slab_bytes):    x2 [T, K], dy2 [T, N]
        ...                                            slab = dW[r0:r0 + R] [R, K], in x2's dtype

Each slab is one cuBLAS GEMM into a workspace of at most `slab_bytes` (whole rows, `policy.slab_rows`),
reused by the next slab: a slab is valid only until the loop asks for the next one. `slab_linear_step` consumes
the slabs with the element-wise kernel; global-norm clipping and gradient accumulation
(`forge_dsl.training.grad_passes`) measure, scale or add them up.
"""

from __future__ import annotations

from typing import Iterator

import torch

from .policy import slab_rows

__all__ = ["slab_grads"]


def slab_grads(x2: torch.Tensor, dy2: torch.Tensor, slab_bytes: int) -> Iterator[tuple[int, torch.Tensor]]:
    """(r0, dW[r0:r0 + R]) for each slab of rows of dW = dy2ᵀ x2 [N, K], in x2's dtype (a float32 product follows
    torch's matmul precision): x2 [T, K], dy2 [T, N]."""
    N, K = dy2.shape[1], x2.shape[1]
    if N == 0 or K == 0:
        return
    rows = slab_rows(N, K, x2.element_size(), slab_bytes)
    workspace = torch.empty(rows, K, dtype=x2.dtype, device=x2.device)  # [rows, K]: one slab of dW
    for r0 in range(0, N, rows):
        slab = workspace[: min(N, r0 + rows) - r0]
        torch.matmul(dy2[:, r0:r0 + slab.shape[0]].t(), x2, out=slab)
        yield r0, slab
