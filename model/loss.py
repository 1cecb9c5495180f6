"""Cross-entropy over the vocabulary without materializing all logits at once.

Shapes: h (N, C) final hidden states, W (V, C) output head, targets (N,) with -100 = ignore.

The loss is the last op of the graph, so its gradient with respect to h and W is known up to
the scalar that flows back into it. `FusedLinearCrossEntropy` therefore computes, chunk by
chunk, the logits (n, V), the loss, and right away the gradients
    dlogits = (softmax(logits) - onehot(target)) / count          (zero rows for ignored targets)
    dh = dlogits @ W,   dW += dlogits^T @ h
and frees the chunk; backward only scales the stored dh, dW by the incoming gradient. Peak
memory holds one chunk of logits, there is no recomputation of the logits matmul, and no
log-softmax backward pass. Without grad mode (evaluation) only the loss is computed.

One softmax pass gives both the loss and dlogits: softmax's largest entry is exp(0) / sum, so
logsumexp = max - log(largest probability) (the largest probability is at least 1/V: no
underflow). On a CPU this is 2.4x faster than logsumexp followed by a second exp over a
(512, 8192) chunk and 2.9x over (1024, 128256) (bench/chunked_ce.py, chunked_ce_cpu.json's
"formulas"); the loss agrees with logsumexp's to fp32 rounding (tested).

The matmuls run in h's dtype (under autocast: the autocast dtype, h cast before the function),
the softmax in fp32; W is cast inside, so a fp32 W gets its fp32 gradient sum unrounded. The
price: the gradient kept from forward to backward is fp32 (V x C x 4 bytes, e.g. 2 GiB at
V = 128k, C = 4096) where it was bf16, once per loss call (MTP: once per depth).
"""

from __future__ import annotations

import torch
from torch import Tensor

IGNORE_INDEX = -100


def normalizer_and_softmax(logits: Tensor) -> tuple[Tensor, Tensor]:
    """logits (n, V) fp32 -> (logsumexp (n,), softmax (n, V)) from one softmax pass."""
    top = logits.amax(dim=-1)
    probs = torch.softmax(logits, dim=-1)
    return top - probs.amax(dim=-1).log(), probs


def chunked_loss(
    h: Tensor, weight: Tensor, targets: Tensor, chunk: int, want_grad: bool
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Mean loss over non-ignored targets, chunk by chunk; with want_grad also its gradients
    (grad_h like h, grad_w fp32 like weight's shape), else None, None (no extra GEMMs)."""
    valid = targets != IGNORE_INDEX
    count = valid.sum().clamp(min=1)
    w = weight.to(h.dtype)  # (V, C) in the matmul dtype
    grad_h = torch.empty_like(h) if want_grad else None
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if want_grad else None
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    step = chunk if 0 < chunk < h.shape[0] else h.shape[0]
    for start in range(0, h.shape[0], step):
        h_c, t_c, v_c = (
            h[start : start + step],
            targets[start : start + step],
            valid[start : start + step],
        )
        logits = (h_c @ w.T).float()  # (n, V)
        safe_t = t_c.clamp(min=0)
        target_logit = logits.gather(1, safe_t[:, None])[:, 0]
        lse, probs = normalizer_and_softmax(logits)
        del logits
        total += ((lse - target_logit) * v_c).sum()
        if not want_grad:
            continue
        probs[torch.arange(len(t_c), device=h.device), safe_t] -= 1.0
        d_logits = probs.to(h.dtype)  # unscaled: the row weights go on the (n, C) side
        scale = (v_c.float() / count)[:, None]  # (n, 1) fp32: 1/count, 0 where ignored
        grad_h[start : start + step] = (d_logits @ w).float() * scale
        grad_w += (d_logits.T @ (h_c.float() * scale).to(h.dtype)).float()  # fp32 sum
    return total / count, grad_h, grad_w


class FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, targets: Tensor, chunk: int) -> Tensor:
        want_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        loss, grad_h, grad_w = chunked_loss(h, weight, targets, chunk, want_grad=want_grad)
        if want_grad:
            ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        return loss

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out.to(grad_h.dtype), grad_w * grad_out.to(grad_w.dtype), None, None


def chunked_cross_entropy(h: Tensor, weight: Tensor, targets: Tensor, chunk_tokens: int) -> Tensor:
    """Mean cross-entropy of `targets` under logits h @ W^T; chunk_tokens=0 computes it in one go."""
    h, targets = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    device = h.device.type
    if torch.is_autocast_enabled(device):
        h = h.to(torch.get_autocast_dtype(device))
    with torch.autocast(device, enabled=False):
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            return FusedLinearCrossEntropy.apply(h, weight, targets, chunk_tokens)
        # evaluation: the loss alone. (An autograd Function's needs_input_grad follows the
        # inputs' requires_grad even under no_grad: it would compute both gradients, 3x the
        # head GEMMs, for nothing.)
        return chunked_loss(h, weight, targets, chunk_tokens, want_grad=False)[0]
