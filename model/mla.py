"""Multi-head latent attention (DeepSeek-V2/V3), registry key "mla".

Shapes: B batch, T new tokens, S keys, C d_model, H heads, Rq query latent (q_lora_rank),
R kv latent (kv_lora_rank), Dn/Dr query-key dims without/with RoPE, Dv value dims.

  q      = W_qb norm(W_qa x)  (or W_q x)           (B, T, H, Dn + Dr)   split into q_nope | q_rope
  c|k_r  = W_kva x                                 (B, T, R + Dr)       joint latent | shared rope key
  c      = norm(c)                                 (B, T, R)            this and rope(k_r) are cached
  k_nope|v = W_kvb c                               (B, T, H, Dn + Dv)
  scores = q_nope . k_nope + rope(q_rope) . rope(k_r)   scaled by (Dn + Dr)^-1/2 (times YaRN's mscale^2)

Training expands the latent into per-head keys and values. With a KV cache the projections are
absorbed instead (W_uk into the query, W_uv after attention), so attention runs directly over the
cached latent as a single shared "kv head" (MQA over R + Dr dims) and nothing per head is stored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import ModelConfig
from model.init import InitStds, init_linear
from model.kv_cache import LatentCache, zeros
from model.masks import AttentionContext
from model.norms import RMSNorm
from model.registry import ATTENTIONS, ROPE_PAIRINGS
from model.rope import softmax_multiplier


@ATTENTIONS.register("mla")
class MultiHeadLatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        m, bias = cfg.attention.mla, cfg.attention.bias
        self.n_heads = cfg.attention.n_heads
        self.nope_dim, self.rope_dim, self.v_dim = (
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.v_head_dim,
        )
        self.kv_rank = m.kv_lora_rank
        C, H, qk_dim = cfg.d_model, self.n_heads, self.nope_dim + self.rope_dim
        if m.q_lora_rank:
            self.q_a_proj = nn.Linear(C, m.q_lora_rank, bias=bias)
            self.q_a_norm = RMSNorm(m.q_lora_rank, cfg.norm_eps)
            self.q_b_proj = nn.Linear(m.q_lora_rank, H * qk_dim, bias=False)
        else:
            self.q_proj = nn.Linear(C, H * qk_dim, bias=False)
        self.kv_a_proj = nn.Linear(C, self.kv_rank + self.rope_dim, bias=bias)
        self.kv_a_norm = RMSNorm(self.kv_rank, cfg.norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_rank, H * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, C, bias=bias)
        self.apply_rope = ROPE_PAIRINGS.get(cfg.rope.pairing)
        self.scale = (cfg.attention.softmax_scale or qk_dim**-0.5) * softmax_multiplier(cfg.rope)

    def _queries(self, x: Tensor) -> Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))

    def forward(self, x: Tensor, ctx: AttentionContext, cache: LatentCache | None = None) -> Tensor:
        B, T, _ = x.shape
        q = self._queries(x).view(B, T, self.n_heads, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        c, k_rope = self.kv_a_proj(x).split([self.kv_rank, self.rope_dim], dim=-1)
        c = self.kv_a_norm(c)  # (B, T, R)
        q_rope = self.apply_rope(q_rope, *ctx.rope)  # (B, T, H, Dr)
        k_rope = self.apply_rope(k_rope[:, :, None, :], *ctx.rope)[:, :, 0]  # (B, T, Dr)
        if cache is None:
            y = self._expanded(q_nope, q_rope, c, k_rope, ctx)
        else:
            c, k_rope = cache.update(c, k_rope, ctx.start)  # (B, S, R), (B, S, Dr)
            y = self._absorbed(q_nope, q_rope, c, k_rope, ctx)
        return self.o_proj(y.reshape(B, T, self.n_heads * self.v_dim))

    def _expanded(
        self, q_nope: Tensor, q_rope: Tensor, c: Tensor, k_rope: Tensor, ctx: AttentionContext
    ) -> Tensor:
        """Per-head keys and values from the latent (training): returns (B, T, H, Dv)."""
        B, S, H = c.shape[0], c.shape[1], self.n_heads
        k_nope, v = (
            self.kv_b_proj(c)
            .view(B, S, H, self.nope_dim + self.v_dim)
            .split([self.nope_dim, self.v_dim], -1)
        )
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(1, 2)  # (B, H, T, Dn + Dr)
        k = torch.cat(
            [k_nope, k_rope[:, :, None, :].expand(B, S, H, self.rope_dim)], dim=-1
        ).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v.transpose(1, 2), attn_mask=ctx.mask, is_causal=ctx.is_causal, scale=self.scale
        )
        return y.transpose(1, 2)

    def _absorbed(
        self, q_nope: Tensor, q_rope: Tensor, c: Tensor, k_rope: Tensor, ctx: AttentionContext
    ) -> Tensor:
        """Attention over the cached latent (generation): returns (B, T, H, Dv)."""
        w = self.kv_b_proj.weight.view(self.n_heads, self.nope_dim + self.v_dim, self.kv_rank)
        w_uk, w_uv = w[:, : self.nope_dim], w[:, self.nope_dim :]  # (H, Dn, R), (H, Dv, R)
        q_latent = torch.einsum(
            "bthn,hnr->bhtr", q_nope, w_uk
        )  # q_nope . k_nope == (q_nope W_uk) . c
        q = torch.cat([q_latent, q_rope.transpose(1, 2)], dim=-1)  # (B, H, T, R + Dr)
        k = torch.cat([c, k_rope], dim=-1)[:, None]  # (B, 1, S, R + Dr): one shared kv head
        y_latent = F.scaled_dot_product_attention(
            q,
            k,
            c[:, None],
            attn_mask=ctx.mask,
            is_causal=ctx.is_causal,
            scale=self.scale,
            enable_gqa=True,
        )  # (B, H, T, R)
        return torch.einsum("bhtr,hvr->bthv", y_latent, w_uv)

    def init_weights(self, stds: InitStds) -> None:
        for name in ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj"):
            if hasattr(self, name):
                init_linear(getattr(self, name), stds.inner)
        init_linear(self.o_proj, stds.out)
        self.kv_a_norm.init_weights()
        if hasattr(self, "q_a_norm"):
            self.q_a_norm.init_weights()

    # ---- accounting and caching hooks ---------------------------------------------------------

    def score_dims(self) -> tuple[int, int, int]:
        return self.n_heads, self.nope_dim + self.rope_dim, self.v_dim

    def kv_cache_elements_per_token(self) -> int:
        """The latent plus the shared rope key: R + Dr (not 2 x H x D)."""
        return self.kv_rank + self.rope_dim

    def make_cache(
        self, batch: int, capacity: int, dtype: torch.dtype, device: torch.device
    ) -> LatentCache:
        like = (dtype, device)
        return LatentCache(
            zeros(batch, capacity, self.kv_rank, like=like),
            zeros(batch, capacity, self.rope_dim, like=like),
        )
