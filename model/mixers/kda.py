"""Kimi Delta Attention (layer kind "kda", Kimi Linear, arXiv 2510.26692): the delta rule with
a decay per key channel.

Shapes: B batch, T new tokens, C d_model, H heads, D head dims (queries, keys and values), K conv.

    q, k, v = SiLU(causal depthwise conv_K([W_q x | W_k x | W_v x]))   restarting at documents
    q, k    = L2-normalized per head (q also x D^-1/2)
    g       = -exp(A_log[h]) softplus(W_fb W_fa x + dt_bias), in fp32      (B, T, H, D) per channel
    beta    = sigmoid(W_b x)                                                (B, T, H)
    o       = the delta rule with per-channel decay (model/mixers/delta_rule.py)
    out     = W_o (RMSNorm(o) * sigmoid(W_gb W_ga x))      fp32 gated norm per head, low-rank gate

The forget and output gates are low rank (C -> D -> H D). Generation keeps a fixed-size state, as
Gated DeltaNet does (model/mixers/gdn.py, whose conv and normalization this layer shares).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import ConfigError, KDAConfig, ModelConfig
from model.init import InitStds, init_linear
from model.mixers.gdn import (
    DeltaRuleMixer,
    GatedDeltaNet,
    conv_qkv,
    l2_normalize,
    state_dtype,
)
from model.mixers.kv_cache import RecurrentState
from model.mixers.masks import AttentionContext
from model.mixers.mixer import LayerDims
from model.norms import GatedRMSNorm
from model.registry import MIXERS

A_MIN, A_MAX = 1.0, 16.0  # initial decay rates exp(A_log), uniform (Kimi Linear)


@MIXERS.register("kda")
class KimiDeltaAttention(DeltaRuleMixer):
    kind = "kda"

    @classmethod
    def check(cls, cfg: ModelConfig) -> None:
        GatedDeltaNet.check(cfg)  # no positions of its own, like Gated DeltaNet

    @classmethod
    def build(cls, cfg: ModelConfig, layer_id: int = 0) -> KimiDeltaAttention:
        return cls(cfg.kda, LayerDims.of(cfg))

    def __init__(self, k: KDAConfig, dims: LayerDims) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.chunk = k.n_heads, k.head_dim, k.chunk_size
        self.kernel = k.kernel  # auto | torch | fla (model/mixers/fla_ops.py)
        self.k_dim = self.v_dim = k.head_dim
        C, H, D = dims.d_model, k.n_heads, k.head_dim
        self.q_proj = nn.Linear(C, H * D, bias=False)
        self.k_proj = nn.Linear(C, H * D, bias=False)
        self.v_proj = nn.Linear(C, H * D, bias=False)
        self.conv = nn.Conv1d(3 * H * D, 3 * H * D, k.conv_kernel, groups=3 * H * D, bias=False)
        self.f_a_proj = nn.Linear(C, D, bias=False)  # the low-rank forget gate
        self.f_b_proj = nn.Linear(D, H * D, bias=False)
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(H * D))
        self.b_proj = nn.Linear(C, H, bias=False)  # beta
        self.g_a_proj = nn.Linear(C, D, bias=False)  # the low-rank output gate
        self.g_b_proj = nn.Linear(D, H * D, bias=False)
        self.norm = GatedRMSNorm(D, dims.norm_eps, activation="sigmoid", strict_fp32=True)
        self.o_proj = nn.Linear(H * D, C, bias=False)

    def forward(
        self, x: Tensor, ctx: AttentionContext, state: RecurrentState | None = None
    ) -> Tensor:
        B, T, _ = x.shape
        D = self.head_dim
        # -1 below: the heads this rank holds (all, or its share under tensor parallelism)
        q, k, v, last_inputs = conv_qkv(self, x, ctx, state)
        dt = state_dtype(x.dtype)
        q = l2_normalize(q.to(dt).view(B, T, -1, D)) * D**-0.5
        k = l2_normalize(k.to(dt).view(B, T, -1, D))
        forget = self.f_b_proj(self.f_a_proj(x)).to(dt) + self.dt_bias.to(dt)
        g = -self.A_log.to(dt).exp()[:, None] * F.softplus(forget.view(B, T, -1, D))
        beta = torch.sigmoid(self.b_proj(x).to(dt))
        q, k, g = (t.transpose(1, 2) for t in (q, k, g))  # (B, H, T, D)
        v_heads, beta = v.to(dt).view(B, T, -1, D).transpose(1, 2), beta.transpose(1, 2)
        o = self.run_rule(q, k, v_heads, g, beta, ctx, state, last_inputs, v.dtype)  # (B, T, H, D)
        gate = self.g_b_proj(self.g_a_proj(x)).view(B, T, -1, D)
        return self.o_proj(self.norm(o, gate).reshape(B, T, -1))

    def tensor_parallel_plan(self, tp: int) -> dict[str, object]:
        """Heads split over `tp` ranks (parallel/tensor_parallel.py): the q, k, v projections,
        beta's, and the low-rank gates' up projections (H D outputs) column-wise, their down
        projections (C -> D) whole on every rank (as MLA's: small, and read by every head);
        the conv's channels over [q | k | v], A_log (per head) and dt_bias (per head and
        channel) by the same heads ("head_rows"); the gated norm's gain (one per head dim,
        shared by the heads) whole with its gradient summed; the output projection row-wise."""
        H, D = self.n_heads, self.head_dim
        if H % tp:
            raise ConfigError(
                f"parallel.tp={tp} must divide the kda layers' {H} heads (model.kda.n_heads)"
            )
        colwise = ("q_proj", "k_proj", "v_proj", "b_proj", "f_b_proj", "g_b_proj")
        plan: dict[str, object] = {name: "colwise" for name in colwise}
        return plan | {
            "f_a_proj": "replicated",
            "g_a_proj": "replicated",
            "conv.weight": ("head_rows", ((H, D),) * 3),
            "A_log": ("head_rows", ((H, 1),)),
            "dt_bias": ("head_rows", ((H, D),)),
            "norm": "head_shared",
            "o_proj": "rowwise",
        }

    @torch.no_grad()
    def init_weights(self, stds: InitStds) -> None:
        gates = (self.b_proj, self.f_a_proj, self.f_b_proj, self.g_a_proj, self.g_b_proj)
        for linear in (self.q_proj, self.k_proj, *gates):
            init_linear(linear, stds.inner)
        init_linear(self.v_proj, stds.value)
        init_linear(self.o_proj, stds.out)
        self.init_conv_and_decay(A_MIN, A_MAX)
        self.norm.init_weights()

    # ---- accounting and generation ------------------------------------------------------------

    def mixing_flops_per_token(self, seq_len: int) -> float:
        """The chunked form per token and head, forward: the two pair products (K_beta K^T and
        Q K^T) weight every channel of every pair by its own decay (2 x 2 C D), the triangular
        solves (C D), the intra-chunk product (C D), reading, correcting and writing the state
        (3 D^2); plus the conv (K per channel)."""
        C, D = min(self.chunk, seq_len), self.head_dim
        per_head = 4 * C * D + C * D + C * D + 3 * D * D
        conv = self.conv.weight.shape[0] * self.conv.weight.shape[-1]
        return 2.0 * (self.n_heads * per_head + conv)

    def describe(self) -> str:
        return f"KDA: {self.n_heads} x {self.head_dim}, conv {self.conv.weight.shape[-1]}"
