"""Cross-entropy over the vocabulary without materializing all logits at once.

Shapes: h (N, C) final hidden states, W (V, C) output head, targets (N,) with -100 = ignore.
The tokens are cut into chunks; each chunk's logits (n, V) are computed, reduced to a summed loss
and freed. Activation checkpointing recomputes a chunk's logits in the backward pass, so peak
memory holds one chunk of logits instead of (N, V) in the forward and again in the backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


def _chunk_loss_sum(h: Tensor, weight: Tensor, targets: Tensor) -> Tensor:
    logits = F.linear(h, weight).float()  # (n, V) in fp32 for a stable log-softmax
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy(h: Tensor, weight: Tensor, targets: Tensor, chunk_tokens: int) -> Tensor:
    """Mean cross-entropy of `targets` under logits h @ W^T; chunk_tokens=0 computes it in one go."""
    h, targets = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    count = (targets != IGNORE_INDEX).sum().clamp(min=1)
    if not chunk_tokens or chunk_tokens >= targets.numel():
        return _chunk_loss_sum(h, weight, targets) / count
    total = torch.zeros((), device=h.device, dtype=torch.float32)
    for h_chunk, t_chunk in zip(h.split(chunk_tokens), targets.split(chunk_tokens)):
        total = total + checkpoint(_chunk_loss_sum, h_chunk, weight, t_chunk, use_reentrant=False)
    return total / count
