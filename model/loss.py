"""Cross-entropy over the vocabulary without materializing all logits at once.

Shapes: h (N, C) final hidden states, W (V, C) output head, targets (N,) with -100 = ignore.

The loss is the last op of the graph, so its gradient with respect to h and W is known up to
the scalar that flows back into it. `GradientsInForward` therefore computes, chunk by
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
"formulas"); the loss agrees with logsumexp's to fp32 rounding (tested). That is the eager
form. Compiled, Inductor fuses max, sum of exponentials, the second exp, the -1 at the target
and the cast into one kernel over the logits when the one-hot is a comparison rather than an
indexed write (loss_chunk_fusable, what parallel.activation.compile_model compiles).

The matmuls run in h's dtype (under autocast: the autocast dtype, h cast before the function),
the softmax in fp32; W is cast inside, so a fp32 W gets its fp32 gradient sum unrounded. The
price: the gradient kept from forward to backward is fp32 (V x C x 4 bytes, e.g. 2 GiB at
V = 128k, C = 4096) where it was bf16, once per loss call (MTP: once per depth).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

IGNORE_INDEX = -100


def normalizer_and_softmax(logits: Tensor) -> tuple[Tensor, Tensor]:
    """logits (n, V) fp32 -> (logsumexp (n,), softmax (n, V)) from one softmax pass."""
    top = logits.amax(dim=-1)
    probs = torch.softmax(logits, dim=-1)
    return top - probs.amax(dim=-1).log(), probs


def loss_chunk(
    h_c: Tensor, w: Tensor, t_c: Tensor, v_c: Tensor, count: Tensor, grad_w_sum: Tensor | None
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """One chunk of n tokens: (the sum of its losses, fp32 0-d; with a grad_w_sum its share of
    the gradients: grad_h (n, C) fp32, and grad_w_sum with the chunk's grad_w added to it in
    place; else None, None). h_c (n, C) and w (V, C) in the matmul dtype; t_c (n,) targets; v_c
    (n,) bool, the targets that count; count: how many count over all chunks (0-d, at least 1);
    grad_w_sum: W's fp32 gradient over the chunks before this one (V, C), or None for the loss
    alone. A function of its inputs alone (as is loss_chunk_fusable, the form compiled), so
    `torch.compile` makes one graph that serves every chunk of every step
    (parallel/activation.py)."""
    logits = (h_c @ w.T).float()  # (n, V)
    safe_t = t_c.clamp(min=0)
    target_logit = logits.gather(1, safe_t[:, None])[:, 0]
    lse, probs = normalizer_and_softmax(logits)
    del logits
    loss_sum = ((lse - target_logit) * v_c).sum()
    if grad_w_sum is None:
        return loss_sum, None, None
    probs[torch.arange(len(t_c), device=h_c.device), safe_t] -= 1.0
    d_logits = probs.to(h_c.dtype)  # unscaled: the row weights go on the (n, C) side
    return loss_sum, *chunk_gradients(d_logits, h_c, w, v_c, count, grad_w_sum)


def chunk_gradients(
    d_logits: Tensor, h_c: Tensor, w: Tensor, v_c: Tensor, count: Tensor, grad_w_sum: Tensor
) -> tuple[Tensor, Tensor]:
    """A chunk's grad_h (n, C) fp32 and grad_w_sum (V, C) fp32 with its grad_w added, from its
    unscaled d_logits (n, V) in the matmul dtype: each row weighted by 1/count, 0 where ignored.
    The sum is taken here rather than by the caller so that, compiled, the widening of the
    matmul's bf16 product and the add are one pass writing into the sum (eager, a CPU add_ of a
    bf16 term into fp32 first copies the term to a fp32 temporary: 5 passes over (V, C) per
    chunk instead of 3), and in fp32 the add goes into the GEMM (addmm). At the default 8 x 256
    tokens (4 chunks), W's gradient took 3.7 ms of a profiled compiled step instead of 11.5;
    timed in the step (two engines in one process taking turns, 40 pairs), 0.4-1.3% faster
    compiled over three runs; eager, where the zeros cost one more pass, 0.4% slower."""
    scale = (v_c.float() / count)[:, None]  # (n, 1) fp32
    grad_h = (d_logits @ w) * scale  # fp32: the bf16 product times an fp32 scale, exactly
    grad_w = d_logits.T @ (h_c.float() * scale).to(h_c.dtype)  # (V, C) in the matmul dtype
    return grad_h, grad_w_sum.add_(grad_w)  # fp32 += bf16: the bf16 term widened exactly


def loss_chunk_fusable(
    h_c: Tensor, w: Tensor, t_c: Tensor, v_c: Tensor, count: Tensor, grad_w_sum: Tensor | None
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """loss_chunk's result written for `torch.compile` (what compile_model compiles): the same
    inputs, outputs and math, with the target's one-hot an iota comparison instead of an indexed
    write, so that Inductor fuses the softmax, the -1 at the target and the cast to the matmul
    dtype into one pass over the logits, with no fp32 (n, V) buffer. Eager this form would
    materialize the mask and two fp32 (n, V) tensors: eager runs keep loss_chunk. Compiled on the
    README's CPU, the chunk's elementwise kernel took 14 ms of a step where loss_chunk's took 36
    (8 x 256 tokens, 4 chunks of (512, 8192)); it agrees with loss_chunk to fp32 rounding in
    the loss and to one bf16 rounding in dlogits (tested)."""
    logits = (h_c @ w.T).float()  # (n, V)
    hit = torch.arange(logits.shape[1], device=logits.device) == t_c.clamp(min=0)[:, None]
    target_logit = torch.where(hit, logits, 0.0).sum(dim=1)  # exact: one nonzero term
    top = logits.amax(dim=1, keepdim=True)
    lse = top + (logits - top).exp().sum(dim=1, keepdim=True).log()  # (n, 1)
    loss_sum = ((lse[:, 0] - target_logit) * v_c).sum()
    if grad_w_sum is None:
        return loss_sum, None, None
    d_logits = ((logits - lse).exp() - hit.float()).to(h_c.dtype)  # unscaled, as loss_chunk's
    return loss_sum, *chunk_gradients(d_logits, h_c, w, v_c, count, grad_w_sum)


ChunkFn = Callable[..., tuple[Tensor, Tensor | None, Tensor | None]]  # loss_chunk's signature
# (h, weight, want_grad) -> (loss, grad_h, grad_w): what GradientsInForward runs
LossWithGradients = Callable[[Tensor, Tensor, bool], tuple[Tensor, Tensor | None, Tensor | None]]


def chunked_loss(
    h: Tensor,
    weight: Tensor,
    targets: Tensor,
    chunk: int,
    chunk_fn: ChunkFn = loss_chunk,
    *,
    want_grad: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Mean loss over non-ignored targets, chunk by chunk (each through chunk_fn: loss_chunk, or
    loss_chunk_fusable compiled); with want_grad also its gradients (grad_h like h, grad_w fp32 like
    weight's shape), else None, None (no extra GEMMs)."""
    valid = targets != IGNORE_INDEX
    count = valid.sum().clamp(min=1)
    w = weight.to(h.dtype)  # (V, C) in the matmul dtype
    grad_h = torch.empty_like(h) if want_grad else None
    # W's gradient summed in fp32 (unrounded) by every chunk in place; zeros rather than the
    # first chunk's term widened, so that every chunk is the same call (one compiled graph)
    grad_w = torch.zeros(w.shape, dtype=torch.float32, device=h.device) if want_grad else None
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    step = chunk if 0 < chunk < h.shape[0] else h.shape[0]
    for start in range(0, h.shape[0], step):
        part = slice(start, start + step)
        loss_sum, grad_h_c, grad_w = chunk_fn(h[part], w, targets[part], valid[part], count, grad_w)
        total += loss_sum
        if want_grad:
            grad_h[part] = grad_h_c
    return total / count, grad_h, grad_w


class GradientsInForward(torch.autograd.Function):
    """A loss whose forward computes its own gradients: `compute(h, weight, want_grad)` gives
    (loss, grad_h, grad_w) (the gradients None unless wanted); backward only scales them by the
    incoming gradient. The fused head + cross-entropy here, and its vocab-parallel form
    (parallel/vocab_parallel.py)."""

    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, compute: LossWithGradients) -> Tensor:
        want_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        loss, grad_h, grad_w = compute(h, weight, want_grad)
        if want_grad:
            ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        return loss

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        grad_h, grad_w = ctx.saved_tensors
        # (always multiplied, also by 1: handing the saved tensors on would let AccumulateGrad
        # keep them as .grad, which a retained graph's next backward then finds changed)
        scaled_h, scaled_w = grad_h * grad_out.to(grad_h.dtype), grad_w * grad_out.to(grad_w.dtype)
        return scaled_h, scaled_w, None


def matmul_input(h: Tensor) -> Tensor:
    """h (..., C) as (N, C) in the matmul dtype (the autocast dtype under autocast)."""
    h = h.reshape(-1, h.shape[-1])
    device = h.device.type
    if torch.is_autocast_enabled(device):
        h = h.to(torch.get_autocast_dtype(device))
    return h


def chunked_cross_entropy(
    h: Tensor, weight: Tensor, targets: Tensor, chunk_tokens: int, chunk_fn: ChunkFn = loss_chunk
) -> Tensor:
    """Mean cross-entropy of `targets` under logits h @ W^T; chunk_tokens=0 computes it in one go.
    chunk_fn: what computes each chunk (loss_chunk, or loss_chunk_fusable compiled)."""
    h, targets = matmul_input(h), targets.reshape(-1)
    device = h.device.type
    with torch.autocast(device, enabled=False):
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):

            def compute(h: Tensor, weight: Tensor, want_grad: bool) -> tuple:
                return chunked_loss(h, weight, targets, chunk_tokens, chunk_fn, want_grad=want_grad)

            return GradientsInForward.apply(h, weight, compute)
        # evaluation: the loss alone. (An autograd Function's needs_input_grad follows the
        # inputs' requires_grad even under no_grad: it would compute both gradients, 3x the
        # head GEMMs, for nothing.)
        return chunked_loss(h, weight, targets, chunk_tokens, chunk_fn, want_grad=False)[0]


@torch.no_grad()
def target_log_probs(h: Tensor, weight: Tensor, targets: Tensor, chunk_tokens: int) -> Tensor:
    """Each target's log-probability under logits h @ W^T, fp32, 0 where the target is ignored:
    h (..., C), targets (...) -> (...). What scoring needs (a continuation's log-likelihood is the
    sum over its tokens), chunk by chunk like the loss, so no (N, V) logits exist at once; only
    the rows with a target are computed. Matmuls in h's dtype (the autocast dtype under autocast),
    the softmax in fp32, as in chunked_cross_entropy."""
    shape = targets.shape
    h, targets = matmul_input(h), targets.reshape(-1)
    device = h.device.type
    out = torch.zeros(targets.shape, dtype=torch.float32, device=h.device)
    rows = (targets != IGNORE_INDEX).nonzero().squeeze(1)
    with torch.autocast(device, enabled=False):
        w = weight.to(h.dtype)
        step = chunk_tokens if chunk_tokens > 0 else max(len(rows), 1)
        for start in range(0, len(rows), step):
            part = rows[start : start + step]
            logits = (h[part] @ w.T).float()  # (n, V)
            picked = logits.gather(1, targets[part, None])[:, 0]
            out[part] = picked - torch.logsumexp(logits, dim=-1)
    return out.view(shape)


def split_targets(targets: Tensor, kept: Tensor, ranks: int) -> tuple[Tensor, Tensor]:
    """Context parallelism (a rank computes positions `kept` (T_local,) of the sequence, the
    `ranks` ranks of its group the rest): this rank's targets (B, T_local) and the weight of
    its mean over them (0-d), ranks x the targets it counts over all counted ones of the whole
    row's targets (B, T). The ranks' weighted means average to the whole sequence's mean, as
    data-parallel ranks' losses average to the batch's (so the ranks' gradients average too)."""
    counted = (targets != IGNORE_INDEX).sum().clamp(min=1)
    local = targets[:, kept]
    return local, ranks * (local != IGNORE_INDEX).sum().clamp(min=1) / counted
