"""What every layer of one forward pass shares (`AttentionContext`): the token ids, positions,
document starts, RoPE rotations and the attention mask.

Shapes: B batch, T new tokens, S = start + T keys (start tokens already in the KV cache), H heads.
The mask is None when plain causal attention suffices (SDPA's `is_causal` fast path) or when no
layer attends through SDPA, else either
a bool tensor (B|1, 1, T, S) with True = may attend, or (ALiBi) a float bias (1|B, H, T, S) with
-inf where attention is not allowed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class AttentionContext:
    positions: Tensor  # (B, T) position of each new token (within its document if doc_ids given)
    # rotary dims R -> (B, T, R/2) complex64 rotations, one entry per R the layers use (a mixer
    # reads ctx.rope[mixer.rotary_dim]); empty (or None) without RoPE
    rope: dict[int, Tensor] | None
    mask: Tensor | None  # see the module docstring
    is_causal: bool  # pass SDPA's is_causal (only when mask is None and there is no cache offset)
    start: int  # tokens already cached before this call
    tokens: Tensor | None = None  # (B, T) the new token ids
    # (B, T) the ids Engram layers hash (compressed to canonical ids) and the 0-d id standing for
    # positions before a document's start; None without Engram layers
    memory_tokens: Tensor | None = None
    memory_pad: Tensor | None = None
    # (B, T) bool, True where a packed document begins (recurrent layers reset their state
    # there); None: each row is one document continuing the cache
    doc_starts: Tensor | None = None
    # what the attention backends other than SDPA read instead of `mask` (which is then None
    # unless a layer uses SDPA; model/mixers/attention_backend.py): the triton kernel's (B|1, T) int32
    # first visible key per row (None: every row sees keys 0..row), FlexAttention's BlockMask
    first_key: Tensor | None = None
    block_mask: object | None = None
    # this forward's share of a sequence split over context-parallel ranks (parallel/
    # context_parallel.py): `attention(q, k, v, window, scale)` attends this rank's queries over
    # every rank's keys; None: the whole sequence is here
    context_parallel: object | None = None

    def rotations(self, rotary_dim: int) -> Tensor | None:
        """(B, T, R/2) rotations for R = rotary_dim, or None (no RoPE, or rotary_dim 0)."""
        if not rotary_dim or not self.rope:
            return None
        return self.rope[rotary_dim]


def document_starts(doc_ids: Tensor) -> Tensor:
    """(B, T) bool, True where a document begins: a document is a run of equal consecutive ids
    (as the loader packs them), so an id that reappears later starts a new document."""
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return starts


def positions_in_documents(doc_ids: Tensor) -> Tensor:
    """Index of each token inside its document: (B, T) doc ids -> (B, T) positions from 0."""
    B, T = doc_ids.shape
    index = torch.arange(T, device=doc_ids.device).expand(B, T)
    starts = document_starts(doc_ids)
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def build_mask(
    T: int,
    start: int,
    *,
    window: int = 0,
    doc_ids: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> tuple[Tensor | None, bool]:
    """(mask, is_causal) for T queries at absolute indices start..start+T-1 over S = start+T keys."""
    if window == 0 and doc_ids is None and alibi_slopes is None:
        if start == 0:
            return None, True
        if T == 1:
            return None, False  # one new token may see the whole cache
    S = start + T
    q_idx = torch.arange(start, S, device=device)[:, None]  # (T, 1)
    k_idx = torch.arange(S, device=device)[None, :]  # (1, S)
    allowed = k_idx <= q_idx  # (T, S) causal
    if window:
        allowed = allowed & (q_idx - k_idx < window)
    allowed = allowed[None, None]  # (1, 1, T, S)
    if doc_ids is not None:
        if start:
            raise ValueError("doc_ids cannot be combined with a KV cache offset (generation)")
        runs = document_starts(doc_ids).cumsum(dim=1)  # (B, T) document number within the row
        same_doc = runs[:, :, None] == runs[:, None, :]  # (B, T, S)
        allowed = allowed & same_doc[:, None]
    if alibi_slopes is None:
        return allowed, False
    distance = (k_idx - q_idx).to(dtype)  # (T, S), <= 0 where allowed
    bias = alibi_slopes.to(device=device, dtype=dtype)[:, None, None] * distance  # (H, T, S)
    return bias[None].masked_fill(~allowed, float("-inf")), False
