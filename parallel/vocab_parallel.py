"""Cross-entropy for a head whose vocabulary is split over the tensor-parallel ranks, chunk by
chunk, never gathering the logits: the tensor-parallel form of model/loss.py.

Shapes: h (N, C) final hidden states, the same on every rank of the TP group; targets (N,), the
same on every rank, -100 = ignore; w_local (V_r, C) this rank's contiguous rows of the head,
vocabulary ids vocab_start ... vocab_start + V_r - 1. Shards may differ in size (the last one
shorter, even empty): each rank passes its own rows and start, so a vocabulary that tp does not
divide needs no padding. `vocab_shard` gives DTensor's Shard(0) split (torch.chunk's: ceil(V/tp)
rows each, the last shorter), which is what a ColwiseParallel head holds.

Per chunk of n tokens (n <= chunk_tokens), with P ranks in the group:
    logits_r = h_c @ w_local^T                                         (n, V_r) fp32, local
    m_r = max_j logits_r,  s_r = sum_j exp(logits_r - m_r),  t_r = the target's logit where r
    holds it, else 0                                                    (3, n) fp32
    one all_gather of (m_r, s_r, t_r) -> (P, 3, n): M = max_r m_r, S = sum_r s_r exp(m_r - M),
    target logit = sum_r t_r, so lse = M + log S and loss = lse - target logit, alike on every
    rank. (One collective where max-then-sum all-reduces take two: each rank's sum-exp is
    rescaled to the global max after the exchange; P x 3n floats, small beside grad_h's nC.)
With gradients, still in forward as FusedLinearCrossEntropy does:
    dlogits_r = (exp(logits_r - lse) - onehot_r(target)) / count        (zero rows if ignored)
    grad_w_local += dlogits_r^T @ h_c                                   (V_r, C) fp32, local
    grad_h_c = sum_r dlogits_r @ w_local_r                              one all_reduce, (n, C) fp32
Backward only scales the stored gradients: no communication. So per chunk: one all_gather of
3n floats (3Pn received), and when training one all_reduce of nC fp32. Peak memory holds one
chunk's (n, V_r) fp32 logits (exponentiated in place) and their dlogits in the matmul dtype;
grad_h is reduced chunk by chunk in fp32 and stored in h's dtype.

dtypes as in model/loss.py: the matmuls in h's dtype (under autocast the autocast dtype, h cast
first), softmax statistics fp32, W's gradient summed in fp32 over the chunks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from model.loss import IGNORE_INDEX, GradientsInForward, chunk_gradients, matmul_input

Group = dist.ProcessGroup | None


def vocab_shard(vocab_size: int, rank: int, tp: int) -> tuple[int, int]:
    """(start, end) of `rank`'s vocabulary rows among `tp` ranks, as DTensor's Shard(0) splits
    them: ceil(vocab_size / tp) rows each, the last shard shorter or empty."""
    size = -(-vocab_size // tp)
    start = min(rank * size, vocab_size)
    return start, min(start + size, vocab_size)


def _all_gather(out: Tensor, tensor: Tensor, group: Group) -> None:
    """Every rank's `tensor` concatenated along dim 0 into `out`. (torch 2.13 renamed
    all_gather_into_tensor to all_gather_single, deprecating the old name; torch >= 2.6 is
    supported.)"""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, tensor, group=group)


def _group_size(group: Group) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _global_stats(
    logits: Tensor, local_t: Tensor, owned: Tensor, group: Group
) -> tuple[Tensor, Tensor, Tensor]:
    """(lse (n,), target logit (n,), this rank's max m_r (n,)) over the whole vocabulary, from this
    rank's logits (n, V_r) fp32, which become exp(logits - m_r) in place (no second (n, V_r)
    buffer); local_t (n,) the targets' local rows (clamped), owned (n,) where this rank holds
    them. One all_gather over `group`."""
    n = logits.shape[0]
    if logits.shape[1]:
        top = logits.amax(dim=1)
        target = logits.gather(1, local_t[:, None])[:, 0] * owned
        sum_exp = logits.sub_(top[:, None]).exp_().sum(dim=1)
    else:  # an empty shard (tp does not divide a small vocabulary): adds nothing
        top = torch.full((n,), -torch.inf, device=logits.device)
        target = sum_exp = torch.zeros(n, device=logits.device)
    mine = torch.stack([top, sum_exp, target])  # (3, n)
    size = _group_size(group)
    if size == 1:
        every = mine[None]
    else:
        every = mine.new_empty((size * 3, n))  # concatenated along dim 0, as gloo requires
        _all_gather(every, mine, group=group)
        every = every.view(size, 3, n)
    tops, sums, targets = every.unbind(1)  # each (P, n)
    global_top = tops.amax(dim=0)
    total = (sums * (tops - global_top).exp()).sum(dim=0)
    return global_top + total.log(), targets.sum(dim=0), top


def _local_targets(t_c: Tensor, v_c: Tensor, vocab_start: int, rows: int) -> tuple[Tensor, Tensor]:
    """The targets' rows in this shard (clamped into it) and where this shard holds them."""
    local = t_c - vocab_start
    owned = v_c & (local >= 0) & (local < rows)
    return local.clamp(0, max(rows - 1, 0)), owned


def _chunk(
    h_c: Tensor,
    w: Tensor,
    t_c: Tensor,
    v_c: Tensor,
    count: Tensor,
    vocab_start: int,
    group: Group,
    grad_w_sum: Tensor | None,
) -> tuple[Tensor, Tensor | None]:
    """One chunk of n tokens: (the sum of its losses, fp32 0-d, alike on every rank; with a
    grad_w_sum the chunk's full grad_h (n, C) fp32, summed over the group, and grad_w_sum
    (V_r, C) fp32 with the chunk's grad_w added in place; else None). h_c and w in the matmul
    dtype, t_c (n,) targets, v_c (n,) bool the targets that count, count: how many count over
    all chunks (0-d, at least 1)."""
    logits = (h_c @ w.T).float()  # (n, V_r)
    local_t, owned = _local_targets(t_c, v_c, vocab_start, w.shape[0])
    lse, target, top = _global_stats(logits, local_t, owned, group)  # logits: exp(logits - m_r)
    loss_sum = ((lse - target) * v_c).sum()
    if grad_w_sum is None:
        return loss_sum, None
    probs = logits.mul_((top - lse).exp()[:, None])  # this shard's part of the full softmax
    rows = owned.nonzero().squeeze(1)
    probs[rows, local_t[rows]] -= 1.0
    d_logits = probs.to(h_c.dtype)  # unscaled: chunk_gradients weights the rows by v_c / count
    del logits, probs
    grad_h, _ = chunk_gradients(d_logits, h_c, w, v_c, count, grad_w_sum)
    if _group_size(group) > 1:
        dist.all_reduce(grad_h, group=group)  # sum over the shards of the vocabulary
    return loss_sum, grad_h


def _chunked_loss(
    h: Tensor,
    w_local: Tensor,
    targets: Tensor,
    chunk: int,
    vocab_start: int,
    group: Group,
    *,
    want_grad: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Mean loss over non-ignored targets; with want_grad also grad_h (like h, full, alike on
    every rank) and grad_w_local (fp32, w_local's shape), else None, None."""
    valid = targets != IGNORE_INDEX
    count = valid.sum().clamp(min=1)
    w = w_local.to(h.dtype)  # (V_r, C) in the matmul dtype
    grad_h = torch.empty_like(h) if want_grad else None
    grad_w = torch.zeros(w.shape, dtype=torch.float32, device=h.device) if want_grad else None
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    step = chunk if 0 < chunk < h.shape[0] else h.shape[0]
    for start in range(0, h.shape[0], step):
        part = slice(start, start + step)
        loss_sum, grad_h_c = _chunk(
            h[part], w, targets[part], valid[part], count, vocab_start, group, grad_w
        )
        total += loss_sum
        if want_grad:
            grad_h[part] = grad_h_c
    return total / count, grad_h, grad_w


def vocab_parallel_cross_entropy(
    h: Tensor,
    w_local: Tensor,
    targets: Tensor,
    chunk_tokens: int,
    vocab_start: int,
    group: Group = None,
) -> Tensor:
    """Mean cross-entropy of `targets` under logits h @ W^T, where this rank holds W's rows
    vocab_start ... vocab_start + len(w_local) - 1 and the other ranks of `group` (None: the
    default group, or one process without a process group) the rest; chunk_tokens=0 computes it
    in one go. h (..., C) and targets (...) the same on every rank. Returns the 0-d fp32 loss,
    alike on every rank; backward gives every rank the full gradient of h and the gradient of
    its own w_local (see the module's docstring for the communication)."""
    h, targets = matmul_input(h), targets.reshape(-1)
    device = h.device.type
    with torch.autocast(device, enabled=False):
        if torch.is_grad_enabled() and (h.requires_grad or w_local.requires_grad):
            # backward needs no communication: every rank holds the full grad_h already

            def compute(h: Tensor, w: Tensor, want_grad: bool) -> tuple:
                return _chunked_loss(
                    h, w, targets, chunk_tokens, vocab_start, group, want_grad=want_grad
                )

            return GradientsInForward.apply(h, w_local, compute)
        # evaluation: the loss alone (no gradient GEMMs, no grad_h all-reduce)
        return _chunked_loss(
            h, w_local, targets, chunk_tokens, vocab_start, group, want_grad=False
        )[0]


@torch.no_grad()
def vocab_parallel_target_log_probs(
    h: Tensor,
    w_local: Tensor,
    targets: Tensor,
    chunk_tokens: int,
    vocab_start: int,
    group: Group = None,
) -> Tensor:
    """Each target's log-probability under logits h @ W^T with W's rows split as in
    vocab_parallel_cross_entropy, fp32, 0 where the target is ignored: h (..., C), targets (...)
    -> (...), alike on every rank. Chunk by chunk over only the rows with a target (the same rows
    on every rank, so the ranks' collectives match): one all_gather of 3n floats per chunk."""
    shape = targets.shape
    h, targets = matmul_input(h), targets.reshape(-1)
    out = torch.zeros(targets.shape, dtype=torch.float32, device=h.device)
    rows = (targets != IGNORE_INDEX).nonzero().squeeze(1)
    with torch.autocast(h.device.type, enabled=False):
        w = w_local.to(h.dtype)
        step = chunk_tokens if chunk_tokens > 0 else max(len(rows), 1)
        for start in range(0, len(rows), step):
            part = rows[start : start + step]
            t_c = targets[part]
            every_row = torch.ones_like(t_c, dtype=torch.bool)
            local_t, owned = _local_targets(t_c, every_row, vocab_start, w.shape[0])
            lse, target, _ = _global_stats((h[part] @ w.T).float(), local_t, owned, group)
            out[part] = target - lse
    return out.view(shape)
