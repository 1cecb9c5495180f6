"""Per-head maximum attention logit (max over the batch of q.k x scale), for QK-clip.

SDPA never materializes the logits, so they are recomputed here, without gradients, in chunks
of queries (at most ~16M logits at a time), only when an attention module's
`record_max_logits` is on. Masked positions (causal, sliding window, documents) do not count;
an ALiBi bias is not part of q.k and is left out.

Shapes: q (B, H, T, D), k (B, K, S, D) with H = K x G, the result (H,) fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK_LOGITS = 1 << 24


@torch.no_grad()
def max_logits_per_head(
    q: Tensor, k: Tensor, scale: float, mask: Tensor | None, is_causal: bool, start: int
) -> Tensor:
    B, H, T, D = q.shape
    K, S = k.shape[1], k.shape[2]
    qg = q.float().view(B, K, H // K, T, D)  # query heads grouped by their kv head
    kt = k.float().transpose(-1, -2)[:, :, None]  # (B, K, 1, D, S)
    rows = max(1, CHUNK_LOGITS // max(1, B * H * S))
    best = torch.full((H,), float("-inf"), device=q.device)
    key_index = torch.arange(S, device=q.device)
    for t0 in range(0, T, rows):
        t1 = min(T, t0 + rows)
        logits = (qg[:, :, :, t0:t1] @ kt) * scale  # (B, K, G, t, S)
        allowed = allowed_keys(mask, is_causal, start, t0, t1, key_index, B, H)
        if allowed is not None:
            logits = logits.masked_fill(~allowed.view(B, K, H // K, t1 - t0, S), float("-inf"))
        best = torch.maximum(best, logits.amax(dim=(0, 3, 4)).reshape(H))
    return best


def allowed_keys(
    mask: Tensor | None, is_causal: bool, start: int, t0: int, t1: int, keys: Tensor, B: int, H: int
) -> Tensor | None:
    """(B, H, t, S) bool of the positions that count, or None for all."""
    if mask is not None:
        part = mask[..., t0:t1, :]
        allowed = part if part.dtype == torch.bool else torch.isfinite(part)
        return allowed.expand(B, H, t1 - t0, keys.numel())
    if is_causal:
        queries = torch.arange(start + t0, start + t1, device=keys.device)[:, None]
        return (keys[None, :] <= queries).expand(B, H, t1 - t0, keys.numel())
    return None
