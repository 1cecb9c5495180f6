"""Small shared pieces for the model tests: tiny configs and slow, obvious reference math.

The references here are written from the formulas, independently of model/ (they never call the
module code they are compared with), so a test that compares against them checks the math.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from model import (
    AttentionConfig,
    FFNConfig,
    InitConfig,
    MLAConfig,
    ModelConfig,
    RopeConfig,
    Transformer,
)

# fp32 comparisons of two computations of the same function (different op order / fused kernels)
ATOL = 1e-5
RTOL = 1e-5


def tiny_config(
    *,
    attention: dict[str, Any] | None = None,
    mla: dict[str, Any] | None = None,
    rope: dict[str, Any] | None = None,
    ffn: dict[str, Any] | None = None,
    init: dict[str, Any] | None = None,
    **model: Any,
) -> ModelConfig:
    """A tiny fp32 model config: V=61, C=32, L=2, H=4 (D=8), max_seq_len=32.

    The init std is 0.2 (not 0.02) so attention patterns are far from uniform and position or
    mask mistakes change the outputs by much more than the comparison tolerances.
    """
    att = dict(n_heads=4)
    att.update(attention or {})
    if mla is not None:
        att["mla"] = MLAConfig(**mla)
    base: dict[str, Any] = dict(vocab_size=61, d_model=32, n_layers=2, max_seq_len=32)
    base.update(model)
    return ModelConfig(
        **base,
        attention=AttentionConfig(**att),
        rope=RopeConfig(**(rope or {})),
        ffn=FFNConfig(**(ffn or {"hidden": 48})),
        init=InitConfig(**({"std": 0.2} | (init or {}))),
    )


def tiny_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(cfg).eval()


def perturb_norm_weights(model: torch.nn.Module, seed: int = 1) -> None:
    """Norm weights start at exactly 1 (biases at 0); make them random so tests see them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.3 * torch.randn(p.shape, generator=g))


# ---- reference RoPE ---------------------------------------------------------------------------


def ref_inv_freq(theta: float, rotary_dim: int) -> Tensor:
    """theta^(-2i/R), i < R/2, in float64 (the references compute in double)."""
    i = torch.arange(rotary_dim // 2, dtype=torch.float64)
    return theta ** (-2 * i / rotary_dim)


def ref_rope(
    x: Tensor,
    positions: Tensor,
    inv_freq: Tensor,
    pairing: str,
    factor: float = 1.0,
) -> Tensor:
    """Rotate the first R = 2 len(inv_freq) dims of each head of x (B, T, H, D); the rest pass.

    half: Hugging Face's `x * cos + rotate_half(x) * sin` with cos/sin repeated over both halves.
    interleaved: Meta's complex form, pair (2i, 2i+1) as a complex number times e^{i pos w_i}.
    cos and sin are multiplied by `factor` (YaRN's attention factor).
    """
    r = 2 * inv_freq.numel()
    rot, rest = x[..., :r].double(), x[..., r:]
    angles = positions.double()[..., None] * inv_freq.double()  # (B, T, R/2)
    if pairing == "half":
        emb = torch.cat([angles, angles], dim=-1)[:, :, None, :]  # (B, T, 1, R)
        cos, sin = emb.cos() * factor, emb.sin() * factor
        x1, x2 = rot[..., : r // 2], rot[..., r // 2 :]
        rotate_half = torch.cat([-x2, x1], dim=-1)
        out = rot * cos + rotate_half * sin
    elif pairing == "interleaved":
        z = torch.view_as_complex(rot.reshape(*rot.shape[:-1], r // 2, 2).contiguous())
        w = torch.polar(torch.full_like(angles, factor), angles)[:, :, None, :]
        out = torch.view_as_real(z * w).flatten(-2)
    else:
        raise ValueError(pairing)
    return torch.cat([out.to(x.dtype), rest], dim=-1)


# ---- reference attention -----------------------------------------------------------------------


def ref_allowed(T: int, start: int = 0, window: int = 0, doc_ids: Tensor | None = None) -> Tensor:
    """(B|1, T, S) bool: key j visible from query i, by explicit loops over (i, j).
    A document is a run of equal consecutive ids: j and i share one when every id between is equal."""
    S = start + T
    B = 1 if doc_ids is None else doc_ids.shape[0]
    allowed = torch.zeros(B, T, S, dtype=torch.bool)
    for b in range(B):
        for t in range(T):
            i = start + t
            for j in range(S):
                ok = j <= i and (window == 0 or i - j < window)
                if doc_ids is not None:
                    ok = ok and bool((doc_ids[b, j : i + 1] == doc_ids[b, i]).all())
                allowed[b, t, j] = ok
    return allowed


def ref_positions_in_documents(doc_ids: Tensor) -> Tensor:
    """Loop form: position counter that restarts whenever the doc id changes."""
    out = torch.zeros_like(doc_ids)
    for b in range(doc_ids.shape[0]):
        pos = 0
        for t in range(doc_ids.shape[1]):
            if t > 0 and doc_ids[b, t] != doc_ids[b, t - 1]:
                pos = 0
            out[b, t] = pos
            pos += 1
    return out


def ref_alibi_slopes(n_heads: int) -> list[float]:
    """Press et al.: 2^(-8 i / n), i = 1..n for powers of two; otherwise the closest power of two
    2^k, then every other slope of the 2^(k+1) ladder for the remaining heads."""
    k = 2 ** math.floor(math.log2(n_heads))
    slopes = [2 ** (-8 * i / k) for i in range(1, k + 1)]
    extra = [2 ** (-8 * i / (2 * k)) for i in range(1, 2 * k + 1, 2)]
    return slopes + extra[: n_heads - k]


def ref_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    allowed: Tensor,
    bias: Tensor | None = None,
) -> Tensor:
    """softmax(q k^T * scale + bias, masked) v in float64.

    q (B, T, H, D), k (B, S, K, D), v (B, S, K, Dv); allowed (B|1, T, S); bias (H, T, S) or None.
    kv heads are repeated: query head h uses kv head h // (H / K). Returns (B, T, H, Dv).
    """
    H, K = q.shape[2], k.shape[2]
    k = k.repeat_interleave(H // K, dim=2).double()
    v = v.repeat_interleave(H // K, dim=2).double()
    scores = torch.einsum("bthd,bshd->bhts", q.double(), k) * scale
    if bias is not None:
        scores = scores + bias.double()[None]
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bhts,bshd->bthd", probs, v).to(q.dtype)


def ref_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    x = x.double()
    return (x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps) * weight.double()).float()
