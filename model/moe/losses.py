"""Load-balancing losses of a router, in fp32 (plain formulas; the coefficients are applied by MoE).

Shapes: N tokens (= B x T), E routed experts, k top_k. Balance losses use normalized scores
p = s / sum_e s (the softmax probabilities as they are; sigmoid scores normalized as DeepSeek-V3
does), and the selection counts (before any capacity dropping). Perfect balance gives 1.
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.moe.slots import expert_counts


def _probs(scores: Tensor) -> Tensor:
    return scores / scores.sum(dim=-1, keepdim=True)


def switch_balance_loss(scores: Tensor, topk_idx: Tensor) -> Tensor:
    """Switch/GShard: E / (k N) x sum_e count_e x mean_t p_te  (DeepSeek's sum_i f_i P_i).

    scores (N, E), topk_idx (N, k) -> scalar."""
    N, k = topk_idx.shape
    E = scores.shape[-1]
    counts = expert_counts(topk_idx.flatten(), E).to(scores.dtype)  # (E,)
    return (counts * _probs(scores).mean(dim=0)).sum() * E / (k * N)


def sequence_balance_loss(scores: Tensor, topk_idx: Tensor, batch: int) -> Tensor:
    """DeepSeek-V3's sequence-wise loss: the Switch loss of each sequence, averaged over sequences.

    scores (B T, E), topk_idx (B T, k) with tokens in (b, t) order -> scalar."""
    N, k = topk_idx.shape
    E, T = scores.shape[-1], N // batch
    probs = _probs(scores).view(batch, T, E)
    ones = torch.ones(batch, T * k, dtype=scores.dtype, device=scores.device)
    counts = torch.zeros(batch, E, dtype=scores.dtype, device=scores.device)
    counts.scatter_add_(1, topk_idx.view(batch, T * k), ones)  # (B, E)
    per_sequence = (counts * probs.mean(dim=1)).sum(dim=-1) * E / (k * T)  # (B,)
    return per_sequence.mean()


def router_z_loss(logits: Tensor) -> Tensor:
    """ST-MoE z-loss: mean over tokens of logsumexp(logits)^2. logits (N, E) -> scalar."""
    return torch.logsumexp(logits, dim=-1).square().mean()
