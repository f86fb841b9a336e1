"""A memory-lean causal-LM loss for `forge-bench model --loss inplace`, in the style of Liger-Kernel's cross-entropy.

transformers' loss (`model(input_ids=ids, labels=ids).loss`) upcasts the whole
[T, V] logits to fp32 and keeps the log-softmax and its gradient: at
2048 tokens × 151936 vocab that is ~3.5 GiB beside the 0.6 GiB of bf16 logits,
and it sets the step's peak memory.  Here the loss and its gradient are computed
in the forward, in fp32 chunks of rows, and the gradient overwrites the logits
in place: the only [T, V] tensor ever allocated is the logits, in the model's
dtype; the fp32 work happens on chunks of about `CHUNK_BYTES` (one working copy
and logsumexp's temporaries).

The loss is the same as transformers' causal-LM loss: labels are the input ids
shifted left by one, the last position ignored, cross-entropy in fp32 averaged
over the positions whose label is not -100.
"""

from __future__ import annotations

from typing import Optional

import torch

IGNORE_INDEX = -100
CHUNK_BYTES = 256 * 2**20  # the fp32 working chunk of rows


class InplaceCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy over the rows whose label is not -100; the gradient is computed in the forward.

    forward(logits [..., V] float (bf16, fp16, fp32 or fp64), contiguous; labels [...] int64 in
    [0, V) or -100; chunk_rows: rows per fp32 chunk, None to size chunks to `CHUNK_BYTES`)
    -> loss [] fp32 (fp64 for fp64 logits).

    Per chunk of rows: upcast to fp32, logsumexp, loss += Σ (logsumexp − logit[label]), and
    (softmax − onehot(label)) / n_valid (zero on ignored rows) written back into the logits in
    their dtype.  The logits are overwritten: they must not be used after this call, nor saved by
    another autograd node (autograd's version check would then fail in backward).  With every
    label ignored the loss is nan and the gradient zero, like `torch.nn.functional.cross_entropy`.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, chunk_rows: Optional[int] = None) -> torch.Tensor:
        if not logits.is_contiguous():
            raise ValueError("InplaceCrossEntropy writes the gradient into the logits: pass contiguous logits.")
        vocab = logits.shape[-1]
        rows = logits.view(-1, vocab)  # [N, V], shares the logits' storage
        labels = labels.reshape(-1)  # [N]
        if labels.numel() != rows.shape[0]:
            raise ValueError(f"InplaceCrossEntropy needs one label per row of logits; got {labels.numel()} "
                             f"labels for {rows.shape[0]} rows.")
        if chunk_rows is not None and (isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int)
                                       or chunk_rows < 1):
            raise ValueError(f"InplaceCrossEntropy: chunk_rows must be a positive integer or None, got {chunk_rows!r}")
        compute_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        chunk_rows = chunk_rows or max(1, CHUNK_BYTES // (4 * vocab))
        valid = labels != IGNORE_INDEX  # [N]
        scale = 1.0 / valid.sum().to(compute_dtype)  # [] (inf when every label is ignored)
        loss_sum = torch.zeros((), dtype=compute_dtype, device=logits.device)
        for start in range(0, rows.shape[0], chunk_rows):
            chunk = rows[start:start + chunk_rows]  # [C, V], a view into the logits
            x = chunk.to(compute_dtype)  # [C, V] fp32 copy (the chunk itself for fp32 logits)
            keep = valid[start:start + chunk_rows]  # [C]
            target = labels[start:start + chunk_rows].clamp(min=0).unsqueeze(1)  # [C, 1], ignored rows → 0
            lse = torch.logsumexp(x, dim=1)  # [C]
            loss_sum += torch.where(keep, lse - x.gather(1, target).squeeze(1), 0).sum()
            x.sub_(lse.unsqueeze(1)).exp_()  # softmax, in place
            x.scatter_add_(1, target, -keep.to(compute_dtype).unsqueeze(1))  # − onehot(label) on kept rows
            x.mul_(torch.where(keep, scale, 0).unsqueeze(1))  # / n_valid; ignored rows → 0 (even if n_valid is 0)
            chunk.copy_(x)
        ctx.save_for_backward(logits.detach())  # now holding d loss / d logits
        return loss_sum * scale

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output: torch.Tensor):
        (grad,) = ctx.saved_tensors  # [..., V] in the logits' dtype
        if grad_output.item() != 1.0:  # loss.backward() passes 1: no [T, V] pass at all (one host sync)
            grad = grad * grad_output  # a new tensor: a retained graph's next backward must see the saved one
        return grad, None, None


def causal_lm_loss_inplace(model, input_ids: torch.Tensor, chunk_rows: Optional[int] = None) -> torch.Tensor:
    """transformers' `model(input_ids=ids, labels=ids).loss` without the fp32 [T, V] copies.

    model: a `*ForCausalLM` with `.model` (the decoder) and `.lm_head` (Llama, Qwen3);
    input_ids [B, S] int64, also the labels.  Returns the loss [] fp32.  The logits
    [B, S, V] stay in the model's dtype; labels are the ids shifted left by one with
    the last position ignored, as in transformers' `ForCausalLMLoss`.
    """
    hidden = model.model(input_ids=input_ids, use_cache=False).last_hidden_state  # [B, S, H]
    logits = model.lm_head(hidden)  # [B, S, V]
    labels = torch.nn.functional.pad(input_ids[:, 1:], (0, 1), value=IGNORE_INDEX)  # [B, S]
    return InplaceCrossEntropy.apply(logits, labels, chunk_rows)
