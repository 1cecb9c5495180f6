"""mHC's Sinkhorn-Knopp projection for eager runs: the recipe of `model.residual.mhc.sinkhorn` with its
backward written out, over a tokens-last layout.

Autograd through the recipe's 2 iters steps on (B, T, n, n) costs about 8 ops a step, each a
reduction or a broadcast over an inner axis of n = 4 (slow on CPU: a 32K-element divide took
73 us), and keeps every step's (B, T, n, n) result until backward. Here the matrices are laid
out (n, n, M), M = B T tokens innermost, so that every row and column sum adds n contiguous
vectors and every divide is contiguous; the forward keeps only the logits, and backward
recomputes the steps (3 ops each) before walking them back (4 ops each). One step
out = c / (c.sum(axis) + eps) has the vector-Jacobian product
    grad_c = (grad_out - sum_axis(grad_out * out)) / (c.sum(axis) + eps),
and the softmax + eps that starts it grad_logits = p (grad_p - sum_last(grad_p p)).
The result equals the recipe's to rounding (the sums add the same n numbers in the same order;
tested, with gradients against float64). Under torch.compile the recipe is used instead:
Inductor fuses its loop (this Function compiled made the tiny_mhc step 1.08-1.09x slower).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _steps(comb: Tensor, iters: int, eps: float, keep: bool) -> tuple[Tensor, list]:
    """The normalization steps on comb (n, n, M): a column step, then (iters - 1) row and
    column steps. keep: also every step's (output, denominator, axis), for backward."""
    kept = []
    axes = [0] + [1, 0] * (iters - 1)  # axis 0 sums a column (over rows j), axis 1 a row
    for axis in axes:
        denominator = comb.sum(axis, keepdim=True).add_(eps)
        comb = comb / denominator
        if keep:
            kept.append((comb, denominator, axis))
    return comb, kept


def _start(logits: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The recipe's softmax over the last axis (..., n, n), and softmax + eps laid out (n, n, M)."""
    probs = torch.softmax(logits, dim=-1)
    return probs, _tokens_last(probs + eps)


def _tokens_last(t: Tensor) -> Tensor:
    """(..., n, n) -> contiguous (n, n, M), M = the product of the leading dims."""
    return t.flatten(0, -3).permute(1, 2, 0).contiguous()


def _tokens_first(t: Tensor, shape: torch.Size) -> Tensor:
    """(n, n, M) -> contiguous `shape` (..., n, n): a strided result would send matmul's bmm
    (the streams' mixing) to its slow per-matrix path."""
    return t.permute(2, 0, 1).contiguous().view(shape)


class _SinkhornTokensLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, iters: int, eps: float) -> Tensor:
        comb, _ = _steps(_start(logits, eps)[1], iters, eps, keep=False)
        ctx.save_for_backward(logits)
        ctx.iters, ctx.eps = iters, eps
        return _tokens_first(comb, logits.shape)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        (logits,) = ctx.saved_tensors
        probs, start = _start(logits, ctx.eps)
        _, kept = _steps(start, ctx.iters, ctx.eps, keep=True)
        g = _tokens_last(grad)
        for out, denominator, axis in reversed(kept):
            g = (g - (g * out).sum(axis, keepdim=True)) / denominator
        g = _tokens_first(g, logits.shape)  # d loss / d (probs + eps) = d loss / d probs
        grad_logits = probs * (g - (g * probs).sum(-1, keepdim=True))
        return grad_logits, None, None


def sinkhorn_tokens_last(logits: Tensor, iters: int, eps: float) -> Tensor:
    """model.residual.mhc.sinkhorn's result, logits (..., n, n) -> (..., n, n), faster in eager mode and
    keeping only the logits for backward."""
    if iters < 1:
        raise ValueError(f"Sinkhorn needs at least one step, got iters={iters}")
    return _SinkhornTokensLast.apply(logits, iters, eps)
