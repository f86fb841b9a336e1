"""A causal LM's head and cross-entropy without the logits: the loss of `lm_head(hidden)`, never a [tokens, vocab]
tensor kept, and the head's weight updated one vocabulary block at a time inside backward.

    loss = causal_lm_loss(hidden, weight, labels, sink=sink)    hidden [B, S, D], weight [V, D], labels [B, S]

(`hf_head.install` gives a Hugging Face causal LM this loss.)

What it computes is transformers' `ForCausalLMLoss` over `logits = lm_head(hidden)`: logits in the head's dtype
(the GEMM's output, bf16 for a bf16 model), then `.float()`; labels padded with `ignore_index` and shifted by one
(or `shift_labels` as given); the mean over the tokens whose target is not `ignore_index`, or the sum divided by
`num_items_in_batch` (what HF Trainer passes under gradient accumulation).

Forward: for each vocabulary block [v0, v1) (`vocab_block_rows`), the block's logits, their log-sum-exp folded
into each token's running one, and the target logit where it falls in the block. It saves hidden [T, D], the
targets [T] and the log-sum-exp [T]. Backward, block by block: the same logits again, the block of their gradient
dY = (softmax − onehot) · (grad · scale) in the head's dtype (as autograd's gradient of the logits), ΔX += dY · W
with the block's old rows, then the block to the sink (`forge_dsl.training.row_updates.RowSink`), which updates
those rows; or, where the sink is None or its `begin()` is False, the block's dW rows into a dense dW for
autograd (exact).
The backward's cost over the dense path is one GEMM [tokens × vocab × D] (the logits again); its largest
temporary is one block's logits (fp32) beside their bf16 copies, `LOGITS_BLOCK_BYTES` · 1.5 at most.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .row_updates import RowSink

__all__ = ["LOGITS_BLOCK_BYTES", "causal_lm_loss", "vocab_block_rows"]


LOGITS_BLOCK_BYTES = 128 * 2**20
"""The most bytes of one vocabulary block's fp32 logits [tokens, rows] (rows a multiple of 128). The backward's
block (its logits in bf16 and fp32, its dY) sits beside the checkpoint inputs and can set the step's peak
(docs/PERF.md, v19 and v20: the block's size against the peak of Llama-3.1-8B's step)."""


def vocab_block_rows(tokens: int, vocab: int, budget_bytes: int = LOGITS_BLOCK_BYTES) -> int:
    """The rows of one vocabulary block for `tokens` tokens: the most multiple of 128 whose fp32 logits
    [tokens, rows] fit in `budget_bytes` (128 at least), and the whole vocabulary where that is fewer rows.
    At 2048 tokens 16384 rows (8 blocks of a 128k vocabulary); at 8192, 4096 rows (32 blocks)."""
    rows = budget_bytes // (4 * max(tokens, 1)) // 128 * 128
    return max(1, min(vocab, max(128, rows)))


# ----------------------------------------------------------------------------
# The loss
# ----------------------------------------------------------------------------


def _block_logits(x: torch.Tensor, w_block: torch.Tensor) -> torch.Tensor:
    """x [T, D] · w_block [R, D]ᵀ as `lm_head` computes it (the head's dtype), then `.float()`: [T, R] fp32."""
    return torch.nn.functional.linear(x, w_block).float()


def _add_product_f32(acc: torch.Tensor, dy: torch.Tensor, w_block: torch.Tensor, scratch: torch.Tensor) -> None:
    """acc [T, D] fp32 += dy [T, R] · w_block [R, D], the product's sum in fp32 (no bf16 rounding per block);
    `scratch` is an fp32 [T, R] buffer that may be overwritten."""
    if dy.dtype == torch.float32:
        acc.addmm_(dy, w_block)
    elif dy.is_cuda:
        acc.add_(torch.mm(dy, w_block, out_dtype=torch.float32))
    else:  # no bf16 -> fp32 GEMM on the CPU: bf16 products are exact in fp32, so this sums what the GPU sums
        acc.addmm_(scratch.copy_(dy), w_block.float())


def _in_block(targets: torch.Tensor, v0: int, v1: int) -> tuple:
    """(whether each target [T] lies in [v0, v1), its column in the block, clamped into it)."""
    hit = (targets >= v0) & (targets < v1)
    return hit, (targets - v0).clamp_(0, v1 - v0 - 1)


class _HeadLossFn(torch.autograd.Function):
    """loss = Σ_valid (lse − target logit) / denom over x [T, D] and weight [V, D], block by block."""

    @staticmethod
    def forward(ctx, x, weight, targets, denom, sink, rows, ignore_index):
        valid = targets != ignore_index
        lse = None
        target_logit = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
        for v0 in range(0, weight.shape[0], rows):
            v1 = min(v0 + rows, weight.shape[0])
            z = _block_logits(x, weight[v0:v1])  # [T, R]
            hit, col = _in_block(targets, v0, v1)
            target_logit = torch.where(hit, z.gather(1, col[:, None]).squeeze(1), target_logit)
            m = z.amax(1)  # [T]
            lse_block = m + z.sub_(m[:, None]).exp_().sum(1).log_()  # torch.logsumexp's formula, in place
            lse = lse_block if lse is None else torch.logaddexp(lse, lse_block)
            del z  # before the next block's logits: one block alive at a time
        loss = torch.where(valid, lse - target_logit, 0.0).sum() / denom
        ctx.save_for_backward(x, targets, lse)
        ctx.denom, ctx.sink, ctx.rows, ctx.ignore_index = denom, sink, rows, ignore_index
        ctx.weight = weight  # not saved through autograd: the sink updates it in place in backward
        ctx.weight_version = weight._version
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        x, targets, lse = ctx.saved_tensors
        weight = ctx.weight
        if weight._version != ctx.weight_version:
            raise RuntimeError("the LM head's weight was modified in place between causal_lm_loss's forward and "
                               "its backward, which recomputes the logits from it; run backward before changing it")
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        fused = need_dw and ctx.sink is not None and ctx.sink.begin()
        V, rows = weight.shape[0], ctx.rows
        # d loss / d logit of each token, per unit of (softmax − onehot); 0 where the target is ignored
        scale = torch.where(targets != ctx.ignore_index, grad_loss.float() / ctx.denom, 0.0)  # [T] fp32
        dx = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if need_dx else None
        dw = torch.empty_like(weight) if need_dw and not fused else None
        for v0 in range(0, V, rows):
            v1 = min(v0 + rows, V)
            w_block = weight[v0:v1]
            p = _block_logits(x, w_block).sub_(lse[:, None]).exp_().mul_(scale[:, None])  # softmax · scale
            hit, col = _in_block(targets, v0, v1)
            p.scatter_add_(1, col[:, None], torch.where(hit, -scale, 0.0)[:, None])  # − onehot · scale
            dy = p.to(weight.dtype)  # [T, R]: autograd's gradient of the logits, in the head's dtype
            if need_dx:
                _add_product_f32(dx, dy, w_block, p)  # the block's old rows, before the sink updates them
            del p
            if fused:
                ctx.sink.fused_rows(x, dy, v0)
            elif need_dw:
                torch.mm(dy.t(), x, out=dw[v0:v1])
            del dy  # before the next block's logits: one block alive at a time
        if fused:
            ctx.sink.finish()
        return (dx.to(x.dtype) if need_dx else None), dw, None, None, None, None, None


def _check_integer_labels(t: Any, name: str, shape: torch.Size) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor of token ids, got {type(t).__name__}")
    if t.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must hold int64 (or int32) token ids, got {t.dtype}")
    if t.shape != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)} but hidden's tokens have shape {tuple(shape)} "
                         f"(hidden [..., D], {name} [...])")


def _check_inputs(hidden, weight, sink, ignore_index, num_items_in_batch, block_rows) -> None:
    if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point() or hidden.dim() < 2:
        raise TypeError("hidden must be a floating-point tensor [..., D] of at least 2 dimensions, got "
                        + (f"{hidden.dtype} of shape {tuple(hidden.shape)}" if isinstance(hidden, torch.Tensor)
                           else type(hidden).__name__))
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] == 0:
        got = f"shape {tuple(weight.shape)}" if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight must be the head's weight [V, D] with V ≥ 1, got {got}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight is [{weight.shape[0]}, {weight.shape[1]}] but hidden's last dimension is "
                         f"{hidden.shape[-1]}")
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden is {hidden.dtype} but weight is {weight.dtype}; lm_head(hidden) needs one dtype")
    if hidden.device != weight.device:
        raise ValueError(f"hidden is on {hidden.device} but weight is on {weight.device}")
    if sink is not None and not all(callable(getattr(sink, m, None)) for m in ("begin", "fused_rows", "finish")):
        raise TypeError(f"sink must be a forge_dsl.training.row_updates.RowSink (begin, fused_rows, finish) or None, "
                        f"got {type(sink).__name__}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, bool) or not (
                isinstance(num_items_in_batch, (int, float))
                or (isinstance(num_items_in_batch, torch.Tensor) and num_items_in_batch.numel() == 1
                    and num_items_in_batch.dtype != torch.bool)):
            raise TypeError(f"num_items_in_batch must be a number or a one-element tensor, got {num_items_in_batch!r}")
    if block_rows is not None and (isinstance(block_rows, bool) or not isinstance(block_rows, int) or block_rows < 1):
        raise ValueError(f"block_rows must be a positive int or None, got {block_rows!r}")
    if torch.is_autocast_enabled(hidden.device.type):
        raise RuntimeError("causal_lm_loss does not run under torch.autocast: its logits are the head's GEMM in "
                           "the weight's dtype. Train the model in bfloat16 (model.bfloat16()) without autocast.")


def causal_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: Optional[torch.Tensor], *,
                   sink: Optional[RowSink] = None, ignore_index: int = -100, num_items_in_batch: Any = None,
                   shift_labels: Optional[torch.Tensor] = None, block_rows: Optional[int] = None) -> torch.Tensor:
    """transformers' causal-LM loss of `logits = hidden · weightᵀ`, never storing the logits: a 0-d fp32 tensor.

    hidden [..., S, D] (fp32 or bf16, the weight's dtype), weight [V, D] (a head without bias), labels [..., S]
    int64 token ids, shifted here (`labels[..., 1:]`, the last position ignored) unless `shift_labels` [..., S]
    gives the targets directly (then `labels` is not read). Tokens whose target is `ignore_index` count for
    nothing. The loss is the mean over the other tokens, or their sum / `num_items_in_batch` where that is given.

    Backward: ΔX, and the weight's gradient handed to `sink` one vocabulary block at a time where `sink.begin()`
    is True (the sink updates those rows: the weight's `.grad` stays None), else returned to autograd as dW [V, D]
    in the weight's dtype. `block_rows` sets the vocabulary block (default `vocab_block_rows`).

    Under `torch.compile` this is the plain path (`F.linear`, `.float()`, `F.cross_entropy`): the compiled graph
    holds the logits and autograd computes dW; `sink` is not used there.
    """
    _check_inputs(hidden, weight, sink, ignore_index, num_items_in_batch, block_rows)
    tokens_shape = hidden.shape[:-1]
    if shift_labels is None:
        _check_integer_labels(labels, "labels", tokens_shape)
        targets = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    else:
        _check_integer_labels(shift_labels, "shift_labels", tokens_shape)
        targets = shift_labels
    targets = targets.to(device=hidden.device, dtype=torch.int64).reshape(-1)
    V, D = weight.shape
    x = hidden.reshape(-1, D)
    if torch.compiler.is_compiling():
        logits = torch.nn.functional.linear(x, weight).float()
        reduction = "mean" if num_items_in_batch is None else "sum"
        loss = torch.nn.functional.cross_entropy(logits, targets, ignore_index=ignore_index, reduction=reduction)
        return loss if num_items_in_batch is None else loss / _on_device(num_items_in_batch, loss.device)
    valid = targets != ignore_index
    outside = valid & ((targets < 0) | (targets >= V))  # would silently count as logit 0
    if targets.device.type == "cuda":  # a device-side assert, as F.cross_entropy's: no host sync every step
        torch._assert_async(~outside.any(), f"forge_dsl.training.hf_head: target ids outside [0, {V}) that are not "
                                            f"ignore_index ({ignore_index})")
    elif outside.any():
        raise ValueError(f"{'shift_labels' if shift_labels is not None else 'labels'} hold "
                         f"{int(outside.sum())} target ids outside [0, {V}) that are not ignore_index "
                         f"({ignore_index}), e.g. {int(targets[outside][0])}")
    denom = valid.sum() if num_items_in_batch is None else _on_device(num_items_in_batch, hidden.device)
    rows = block_rows or vocab_block_rows(x.shape[0], V)
    return _HeadLossFn.apply(x, weight, targets, denom, sink, rows, ignore_index)


def _on_device(n: Any, device: torch.device) -> Any:
    """num_items_in_batch as HF's loss divides by it: a tensor moved to the loss's device, a number as it is."""
    return n.to(device).reshape(()) if isinstance(n, torch.Tensor) else n
