"""Causal self-attention for MHA / GQA / MQA (registry key "gqa"), through SDPA.

Shapes: B batch, T new tokens, S keys (cached + new), C d_model, H query heads, K kv heads
(H % K == 0; K = H is MHA, K = 1 is MQA), D head dims.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from model.config import AttentionConfig, ConfigError, ModelConfig, check_rotary_dim
from model.init import InitStds, init_linear
from model.mixers.attention_backend import KernelChoice, check_backend, kernel_fits
from model.mixers.kv_cache import KVCache
from model.mixers.masks import AttentionContext
from model.mixers.mixer import LayerDims, QKClipHooks, StateSize, TokenMixer, average_context
from model.mixers.rope import rope_applier, softmax_multiplier
from model.norms import RMSNorm
from model.registry import ATTENTIONS, MIXERS


@MIXERS.register("gqa")
@ATTENTIONS.register("gqa")
class Attention(KernelChoice, TokenMixer, QKClipHooks):
    kind = "gqa"

    @classmethod
    def check(cls, cfg: ModelConfig) -> None:
        att = cfg.attention
        if att.head_dim == 0 and cfg.d_model % att.n_heads:
            raise ConfigError(
                f"model.d_model={cfg.d_model} is not divisible by model.attention.n_heads={att.n_heads}; "
                "set model.attention.head_dim explicitly"
            )
        check_backend(att.backend, alibi=cfg.position == "alibi", head_dims=(cfg.head_dim,) * 2)
        if cfg.position != "rope":
            return
        exact = cfg.head_dim * cfg.rope.fraction
        if not (exact == int(exact) and int(exact) % 2 == 0 and exact > 0):
            raise ConfigError(
                f"RoPE rotates pairs of dims: model.attention.head_dim={cfg.head_dim} x "
                f"model.rope.fraction={cfg.rope.fraction} = {exact:g} must be a positive even integer"
            )
        check_rotary_dim(cfg.rope, int(exact), "model.attention.head_dim x model.rope.fraction")

    @classmethod
    def rotary_dim_for(cls, cfg: ModelConfig) -> int:
        return int(cfg.head_dim * cfg.rope.fraction) if cfg.position == "rope" else 0

    @classmethod
    def build(cls, cfg: ModelConfig, layer_id: int = 0) -> Attention:
        layer = cls(cfg.attention, LayerDims.of(cfg))
        layer.kernel_fits = kernel_fits(cfg.position == "alibi", (layer.head_dim, layer.head_dim))
        return layer

    def __init__(self, a: AttentionConfig, dims: LayerDims) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = a.n_heads, a.n_kv_heads or a.n_heads
        self.head_dim = a.head_dim or dims.d_model // a.n_heads
        self.window = a.sliding_window
        self.backend = a.backend
        C, H, K, D = dims.d_model, self.n_heads, self.n_kv_heads, self.head_dim
        self.q_proj = nn.Linear(C, H * D, bias=a.bias)
        self.k_proj = nn.Linear(C, K * D, bias=a.bias)
        self.v_proj = nn.Linear(C, K * D, bias=a.bias)
        self.o_proj = nn.Linear(H * D, C, bias=a.bias)
        self.gate_proj = nn.Linear(C, H * D, bias=a.bias) if a.output_gate else None
        self.q_norm = RMSNorm(D, dims.norm_eps) if a.qk_norm else None
        self.k_norm = RMSNorm(D, dims.norm_eps) if a.qk_norm else None
        rope = dims.rope
        self.rotary_dim = int(D * rope.fraction) if rope is not None else 0
        self.rope_pairing = rope.pairing if rope is not None else None
        self.apply_rope = rope_applier(rope.pairing) if rope is not None else None
        multiplier = softmax_multiplier(rope) if rope is not None else 1.0
        self.scale = (a.softmax_scale or D**-0.5) * multiplier

    def forward(self, x: Tensor, ctx: AttentionContext, state: KVCache | None = None) -> Tensor:
        B, T, _ = x.shape
        # -1: the heads this rank holds (all, or its share under tensor parallelism)
        q = self.q_proj(x).view(B, T, -1, self.head_dim)
        k = self.k_proj(x).view(B, T, -1, self.head_dim)
        v = self.v_proj(x).view(B, T, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        rot = ctx.rotations(self.rotary_dim)
        if rot is not None:
            q, k = self.apply_rope(q, rot), self.apply_rope(k, rot)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H|K, T, D)
        if state is not None:
            k, v = state.update(k, v, ctx.start)  # (B, K, S, D)
        y = self.attend(q, k, v, ctx, self.scale)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, -1)
        if self.gate_proj is not None:
            y = y * torch.sigmoid(self.gate_proj(x))
        return self.o_proj(y)

    def init_weights(self, stds: InitStds) -> None:
        init_linear(self.q_proj, stds.inner)
        init_linear(self.k_proj, stds.inner)
        init_linear(self.v_proj, stds.value)
        init_linear(self.o_proj, stds.out)
        if self.gate_proj is not None:
            init_linear(self.gate_proj, stds.inner)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.init_weights()

    def tensor_parallel_plan(self, tp: int) -> dict[str, object]:
        """Heads split over `tp` ranks (parallel/tensor_parallel.py): q, k, v and the output
        gate column-wise (each rank computes its heads), the output projection row-wise (its
        all-reduce gives every rank the whole output), QK-norm's gains whole on every rank with
        their gradient summed over the ranks. With fewer kv heads than ranks (tp a multiple of
        them), k and v are whole on every rank, which computes the one kv head its query heads
        use (Megatron's choice; torchtitan refuses): rank r's query heads [r H / tp, (r+1) H / tp)
        all lie in kv head r K / tp, as `head_rows` picks."""
        H, K = self.n_heads, self.n_kv_heads
        if H % tp or (K % tp and tp % K):
            raise ConfigError(
                f"parallel.tp={tp} must divide the attention's {H} query heads and divide or be "
                f"a multiple of its {K} key/value heads (model.attention.n_heads, n_kv_heads)"
            )
        kv = "colwise" if K % tp == 0 else ("colwise_replicated", K)
        plan: dict[str, object] = {"q_proj": "colwise", "k_proj": kv, "v_proj": kv}
        if self.gate_proj is not None:
            plan["gate_proj"] = "colwise"
        plan["o_proj"] = "rowwise"
        if self.q_norm is not None:  # one gain vector for every head: each rank's is partial
            plan |= {"q_norm": "head_shared", "k_norm": "head_shared"}
        return plan

    def qk_clip_blocker(self) -> str | None:
        if self.q_norm is not None:
            return (
                "uses QK-norm (model.attention.qk_norm=true): it normalizes q and k after the "
                "projections, so QK-clip's weight scaling has no effect"
            )
        return None

    def qk_clip_row_scales(self, gamma: Tensor) -> list[tuple[Tensor, Tensor]]:
        """QK-clip: (parameter, per-row factor) pairs that scale head h's logits by gamma[h].

        MHA: W_q and W_k head rows each by sqrt(gamma). GQA/MQA: a key head serves several query
        heads, so each query head's W_q rows take its whole gamma and W_k stays untouched: every
        head's logits are capped exactly and heads that need no clipping keep their weights."""
        D = self.head_dim
        per_row = gamma.repeat_interleave(D)  # (H * D,)
        if self.n_kv_heads != self.n_heads:
            pairs = [(self.q_proj.weight, per_row)]
            if self.q_proj.bias is not None:
                pairs.append((self.q_proj.bias, per_row))
            return pairs
        root = per_row.sqrt()
        pairs = [(self.q_proj.weight, root), (self.k_proj.weight, root)]
        pairs += [(lin.bias, root) for lin in (self.q_proj, self.k_proj) if lin.bias is not None]
        return pairs

    # ---- accounting and caching hooks ---------------------------------------------------------

    def muon_matrix_blocks(self) -> dict[str, tuple[int, int, tuple[int, ...]]]:
        """Per-head layout of each projection for optimizers that treat heads as matrices:
        weight name -> (dim, heads, per-head parts); `dim` (0 rows, 1 columns) is (heads, sum)."""
        H, K, D = self.n_heads, self.n_kv_heads, self.head_dim
        blocks = {
            "q_proj.weight": (0, H, (D,)),
            "k_proj.weight": (0, K, (D,)),
            "v_proj.weight": (0, K, (D,)),
            "o_proj.weight": (1, H, (D,)),
        }
        if self.gate_proj is not None:
            blocks["gate_proj.weight"] = (0, H, (D,))
        return blocks

    def score_width(self) -> int:
        """H x (Dqk + Dv): multiply-adds per (query, key) pair, and an MHA cache's elements per token."""
        return self.n_heads * 2 * self.head_dim

    def mixing_flops_per_token(self, seq_len: int) -> float:
        """QK^T and AV: 2 x H (Dqk + Dv) per (query, key) pair over the causal average context."""
        return 2.0 * self.score_width() * average_context(seq_len, self.window)

    def state_size(self) -> StateSize:
        """2 x K x D per token: keys and values of the kv heads only."""
        return StateSize(
            per_token=2 * self.n_kv_heads * self.head_dim, mha_per_token=self.score_width()
        )

    def describe(self) -> str:
        H, K = self.n_heads, self.n_kv_heads
        name = "MHA" if K == H else "MQA" if K == 1 else "GQA"
        return f"{name}: {H}q / {K}kv x {self.head_dim}"

    def new_state(
        self, batch: int, capacity: int, dtype: torch.dtype, device: torch.device
    ) -> KVCache:
        shape = (batch, self.local_heads(self.n_kv_heads), capacity, self.head_dim)
        return KVCache(
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
