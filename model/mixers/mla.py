"""Multi-head latent attention (DeepSeek-V2/V3), registry key "mla".

Shapes: B batch, T new tokens, S keys, C d_model, H heads, Rq query latent (q_lora_rank),
R kv latent (kv_lora_rank), Dn/Dr query-key dims without/with RoPE, Dv value dims.

  q      = W_qb norm(W_qa x)  (or W_q x)           (B, T, H, Dn + Dr)   split into q_nope | q_rope
  c|k_r  = W_kva x                                 (B, T, R + Dr)       joint latent | shared rope key
  c      = norm(c)                                 (B, T, R)            this and rope(k_r) are cached
  k_nope|v = W_kvb c                               (B, T, H, Dn + Dv)
  scores = q_nope . k_nope + rope(q_rope) . rope(k_r)   scaled by (Dn + Dr)^-1/2 (times YaRN's mscale^2)

Training and prefill (T > 1) expand the latent into per-head keys and values, which runs through
the fused attention kernels. Decoding one token absorbs the projections instead (W_uk into the
query, W_uv after attention), so attention reads the cached latent directly as a single shared
"kv head" (MQA over R + Dr dims): nothing per head is stored or re-expanded per step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import AttentionConfig, ConfigError, ModelConfig, check_rotary_dim
from model.init import InitStds, init_linear, trunc_normal_
from model.mixers.attention_backend import KernelChoice, check_backend, kernel_fits
from model.mixers.kv_cache import LatentCache
from model.mixers.masks import AttentionContext
from model.mixers.mixer import (
    LayerDims,
    QKClipHooks,
    StateSize,
    TokenMixer,
    average_context,
    local_part,
)
from model.mixers.rope import rope_applier, softmax_multiplier
from model.norms import RMSNorm
from model.registry import ATTENTIONS, MIXERS


@MIXERS.register("mla")
@ATTENTIONS.register("mla")
class MultiHeadLatentAttention(KernelChoice, TokenMixer, QKClipHooks):
    kind = "mla"

    @classmethod
    def check_section(cls, section: object) -> None:
        for flag in ("qk_norm", "output_gate"):  # options of the gqa kind's projections
            if getattr(section, flag):
                raise ConfigError(
                    f"model.attention.{flag}=true is not supported with attention.kind='mla'"
                )

    @classmethod
    def check(cls, cfg: ModelConfig) -> None:
        cls.check_section(cfg.attention)  # also when mla comes from layer_types
        m = cfg.attention.mla
        head_dims = (m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim)
        check_backend(cfg.attention.backend, alibi=cfg.position == "alibi", head_dims=head_dims)
        if cfg.attention.mla.nope:
            return  # nothing rotates: any position setting of the other layers goes
        if cfg.position != "rope":
            raise ConfigError(
                f"model.position={cfg.position!r}: MLA uses decoupled RoPE; set model.position=rope "
                "(or model.attention.mla.nope=true for MLA without RoPE)"
            )
        if cfg.rope.fraction != 1.0:
            raise ConfigError(
                "model.rope.fraction must be 1.0 with MLA (its rope part is attention.mla.qk_rope_head_dim)"
            )
        check_rotary_dim(
            cfg.rope, cfg.attention.mla.qk_rope_head_dim, "model.attention.mla.qk_rope_head_dim"
        )

    @classmethod
    def rotary_dim_for(cls, cfg: ModelConfig) -> int:
        return 0 if cfg.attention.mla.nope else cfg.attention.mla.qk_rope_head_dim

    @classmethod
    def build(cls, cfg: ModelConfig, layer_id: int = 0) -> MultiHeadLatentAttention:
        layer = cls(cfg.attention, LayerDims.of(cfg))
        layer.kernel_fits = kernel_fits(
            cfg.position == "alibi", (layer.nope_dim + layer.rope_dim, layer.v_dim)
        )
        return layer

    def __init__(self, a: AttentionConfig, dims: LayerDims) -> None:
        super().__init__()
        m, bias = a.mla, a.bias
        eps = m.norm_eps or dims.norm_eps
        if dims.rope is None and not m.nope:
            raise ConfigError("MLA uses decoupled RoPE; set model.position=rope (or mla.nope=true)")
        self.n_heads, self.kv_rank = a.n_heads, m.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = (
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.v_head_dim,
        )
        C, H, qk_dim = dims.d_model, self.n_heads, self.nope_dim + self.rope_dim
        self.rotary_dim = 0 if m.nope or dims.rope is None else self.rope_dim
        self.window = a.sliding_window
        self.backend = a.backend
        # queries: full rank (q_proj) or through a normalized bottleneck (q_a_proj -> q_b_proj)
        low_rank_q = m.q_lora_rank > 0
        self.q_proj = None if low_rank_q else nn.Linear(C, H * qk_dim, bias=False)
        self.q_a_proj = nn.Linear(C, m.q_lora_rank, bias=bias) if low_rank_q else None
        self.q_a_norm = RMSNorm(m.q_lora_rank, eps) if low_rank_q else None
        self.q_b_proj = nn.Linear(m.q_lora_rank, H * qk_dim, bias=False) if low_rank_q else None
        self.kv_a_proj = nn.Linear(C, self.kv_rank + self.rope_dim, bias=bias)
        self.kv_a_norm = RMSNorm(self.kv_rank, eps)
        self.kv_b_proj = nn.Linear(self.kv_rank, H * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, C, bias=bias)
        # where the one rope key meets every head: an identity, which tensor parallelism makes
        # sum the key's gradient over the ranks (each rank's heads give part of it)
        self.rope_key_to_heads = nn.Identity()
        rotate = self.rotary_dim > 0
        self.rope_pairing = dims.rope.pairing if rotate else None
        self.apply_rope = rope_applier(dims.rope.pairing) if rotate else None
        multiplier = softmax_multiplier(dims.rope) if rotate else 1.0
        self.scale = (a.softmax_scale or qk_dim**-0.5) * multiplier

    def qk_clip_row_scales(self, gamma: Tensor) -> list[tuple[Tensor, Tensor]]:
        """QK-clip rows for gamma (H,): q_nope and k_nope rows by sqrt(gamma), the per-head
        q_rope rows by gamma; the rope key (shared by all heads) and the values stay."""
        root = gamma.sqrt()[:, None]  # (H, 1)
        q_rows = torch.cat(
            [root.expand(-1, self.nope_dim), gamma[:, None].expand(-1, self.rope_dim)], dim=1
        ).flatten()  # (H * (Dn + Dr),): rows of head h are [nope | rope]
        kv_rows = torch.cat(
            [root.expand(-1, self.nope_dim), torch.ones_like(root).expand(-1, self.v_dim)], dim=1
        ).flatten()  # (H * (Dn + Dv),): rows of head h are [k_nope | v]
        q_weight = (self.q_proj or self.q_b_proj).weight
        return [(q_weight, q_rows), (self.kv_b_proj.weight, kv_rows)]

    def _queries(self, x: Tensor) -> Tensor:
        if self.q_proj is not None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))

    def forward(self, x: Tensor, ctx: AttentionContext, state: LatentCache | None = None) -> Tensor:
        B, T, _ = x.shape
        # -1: the heads this rank holds (all, or its share under tensor parallelism)
        q = self._queries(x).view(B, T, -1, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        c, k_rope = self.kv_a_proj(x).split([self.kv_rank, self.rope_dim], dim=-1)
        c = self.kv_a_norm(c)  # (B, T, R)
        rot = ctx.rotations(self.rotary_dim)
        if rot is not None:  # (NoPE: the rope part stays as projected)
            q_rope = self.apply_rope(q_rope, rot)  # (B, T, H, Dr)
            k_rope = self.apply_rope(k_rope[:, :, None, :], rot)[:, :, 0]  # (B, T, Dr)
        if state is not None:
            c, k_rope = state.update(c, k_rope, ctx.start)  # (B, S, R), (B, S, Dr)
        attend = self._expanded if T > 1 else self._absorbed
        y = attend(q_nope, q_rope, c, k_rope, ctx)  # (B, T, H, Dv)
        return self.o_proj(y.reshape(B, T, -1))

    def _expanded(
        self, q_nope: Tensor, q_rope: Tensor, c: Tensor, k_rope: Tensor, ctx: AttentionContext
    ) -> Tensor:
        """Per-head keys and values from the latent (training, prefill)."""
        B, S, H = c.shape[0], c.shape[1], q_nope.shape[2]
        kv = self.kv_b_proj(c).view(B, S, H, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1).transpose(1, 2)  # (B, H, T, Dn + Dr)
        k_rope = self.rope_key_to_heads(k_rope)[:, :, None, :].expand(B, S, H, self.rope_dim)
        k = torch.cat([k_nope, k_rope], dim=-1).transpose(1, 2)  # (B, H, S, Dn + Dr)
        y = self.attend(q, k, v.transpose(1, 2), ctx, self.scale)  # (B, H, T, Dv)
        return y.transpose(1, 2)

    def _absorbed(
        self, q_nope: Tensor, q_rope: Tensor, c: Tensor, k_rope: Tensor, ctx: AttentionContext
    ) -> Tensor:
        """Attention straight over the latent (decoding): q_nope . k_nope == (q_nope W_uk) . c."""
        # (this rank's heads' rows under tensor parallelism, which splits kv_b_proj by heads)
        w = local_part(self.kv_b_proj.weight).view(-1, self.nope_dim + self.v_dim, self.kv_rank)
        w_uk, w_uv = w[:, : self.nope_dim], w[:, self.nope_dim :]  # (H, Dn, R), (H, Dv, R)
        q_latent = torch.einsum("bthn,hnr->bhtr", q_nope, w_uk)
        q = torch.cat([q_latent, q_rope.transpose(1, 2)], dim=-1)  # (B, H, T, R + Dr)
        k_rope = self.rope_key_to_heads(k_rope)
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

    def tensor_parallel_plan(self, tp: int) -> dict[str, str]:
        """Heads split over `tp` ranks (parallel/tensor_parallel.py), as torchtitan's DeepSeek-V3
        plan: the low-rank down projections and their norms whole on every rank (small, and
        the latent feeds every head), the up projections column-wise by heads, the output
        projection row-wise. Each whole part computes the same thing on every rank from the
        whole input and gets its whole gradient back (the column-wise projections sum their
        input's gradient over the ranks; the rope key, used by each rank's heads directly,
        sums its gradient in `rope_key_to_heads`)."""
        if self.n_heads % tp:
            raise ConfigError(
                f"parallel.tp={tp} must divide the MLA attention's {self.n_heads} heads "
                "(model.attention.n_heads)"
            )
        if self.q_proj is not None:
            plan = {"q_proj": "colwise"}
        else:
            plan = {"q_a_proj": "replicated", "q_a_norm": "replicated", "q_b_proj": "colwise"}
        return plan | {
            "kv_a_proj": "replicated",
            "kv_a_norm": "replicated",
            "rope_key_to_heads": "copy_to_heads",
            "kv_b_proj": "colwise",
            "o_proj": "rowwise",
        }

    def init_weights(self, stds: InitStds) -> None:
        for linear in (self.q_proj, self.q_a_proj, self.q_b_proj, self.kv_a_proj):
            if linear is not None:
                init_linear(linear, stds.inner)
        # kv_b_proj's rows are [k_nope | v] per head: keys take the inner std, values the value std
        weight = self.kv_b_proj.weight.view(self.n_heads, self.nope_dim + self.v_dim, self.kv_rank)
        trunc_normal_(weight[:, : self.nope_dim], stds.inner)
        trunc_normal_(weight[:, self.nope_dim :], stds.value)
        init_linear(self.o_proj, stds.out)
        for norm in (self.kv_a_norm, self.q_a_norm):
            if norm is not None:
                norm.init_weights()

    # ---- accounting and caching hooks ---------------------------------------------------------

    def muon_matrix_blocks(self) -> dict[str, tuple[int, int, tuple[int, ...]]]:
        """Layout of each projection for optimizers that treat heads or fused parts as matrices:
        weight name -> (dim, heads, per-head parts); `dim` (0 rows, 1 columns) is (heads, sum).
        kv_a fuses the latent and the shared rope key; kv_b fuses each head's k_nope and v."""
        H, qk_dim = self.n_heads, self.nope_dim + self.rope_dim
        q_name = "q_proj.weight" if self.q_proj is not None else "q_b_proj.weight"
        return {
            q_name: (0, H, (qk_dim,)),
            "kv_a_proj.weight": (0, 1, (self.kv_rank, self.rope_dim)),
            "kv_b_proj.weight": (0, H, (self.nope_dim, self.v_dim)),
            "o_proj.weight": (1, H, (self.v_dim,)),
        }

    def score_width(self) -> int:
        """H x (Dqk + Dv): multiply-adds per (query, key) pair, and an MHA cache's elements per token."""
        return self.n_heads * (self.nope_dim + self.rope_dim + self.v_dim)

    def mixing_flops_per_token(self, seq_len: int) -> float:
        return 2.0 * self.score_width() * average_context(seq_len, self.window)

    def state_size(self) -> StateSize:
        """The latent plus the shared rope key per token: R + Dr (not 2 x H x D)."""
        return StateSize(per_token=self.kv_rank + self.rope_dim, mha_per_token=self.score_width())

    def describe(self) -> str:
        return (
            f"MLA{' (NoPE)' if self.rotary_dim == 0 else ''}: {self.n_heads} x "
            f"({self.nope_dim}+{self.rope_dim} qk, {self.v_dim} v), latent {self.kv_rank}"
        )

    def new_state(
        self, batch: int, capacity: int, dtype: torch.dtype, device: torch.device
    ) -> LatentCache:
        latent = torch.zeros(batch, capacity, self.kv_rank, dtype=dtype, device=device)
        rope_key = torch.zeros(batch, capacity, self.rope_dim, dtype=dtype, device=device)
        return LatentCache(latent, rope_key)
