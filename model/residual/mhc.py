"""mHC: manifold-constrained hyper-connections (DeepSeek, arXiv 2512.24880; `model.residual=mhc`):
n parallel residual streams mixed by a doubly-stochastic-projected matrix at every sublayer.

Shapes: B batch, T tokens, n streams, C d_model. The state is x (B, T, n, C); the embedding enters
as n copies. Per sublayer, in fp32, in transformers' DeepSeek-V4 convention exactly
(models/deepseek_v4/modeling_deepseek_v4.py::DeepseekV4HyperConnection):

    z          = RMSNorm(flatten(x)) fn^T     unweighted norm over n C; fn ((2 + n) n, n C)
    [a | p | m] = z split as [pre n | post n | comb n^2], b = base likewise, s = scale (3,)
    pre        = sigmoid(a s_0 + b_pre) + eps                                     (B, T, n)
    post       = 2 sigmoid(p s_1 + b_post)                                        (B, T, n)
    comb       = softmax(m s_2 + b_comb, over the last axis) + eps                (B, T, n, n)
    comb      <- comb / (column sums + eps), then (iters - 1) x (rows, then columns)
    out_k      = post_k F(norm(sum_j pre_j x_j)) + sum_j comb_jk x_j             (comb transposed)

Sinkhorn-Knopp with 20 iterations is only approximately doubly stochastic (the columns sum to 1
after the last step, the rows to within a few percent): tests check this recipe, not the
property. The streams collapse before the final norm: learned (DeepseekV4HyperHead:
sum_j (sigmoid(RMSNorm(flatten(x)) . hc_fn_j hc_scale + hc_base_j) + eps) x_j) or their mean.

Initialization (chosen): near-uniform at any width: fn ~ N(0, init.std) and base 0 as
transformers' DeepSeek-V4 init, but the scales at Megatron-LM's gating factor 0.01 instead of 1
(with scale 1 the logits' std is init.std x sqrt(n C): 3.4 at DeepSeek-V3's width, where post
already spans 7e-5 .. 2). At the start pre ~ 1/2 and post ~ 1 per stream and comb ~ 1/n: since
the streams start equal, out_k ~ x + F(norm(x)), the pre-norm update, with fn's noise breaking
the symmetry between streams (with fn = 0 they would stay equal forever).

Memory: the maps are small per token ((2 + n) n numbers). Autograd through the Sinkhorn steps
keeps 2 iters (B, T, n, n) tensors for backward, more than the (B, T, n C) streams themselves at
n = 4 and C = 256: eager runs take model/residual/mhc_sinkhorn.py's version, which keeps only the logits
(and is 3x faster); compiled blocks keep what Inductor chooses. `mhc.recompute_maps` recomputes
all the maps in backward (bench/residual_streams.py).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from model import roles
from model.config import ModelConfig
from model.norms import wide_dtype
from model.registry import RESIDUALS
from model.residual.mhc_sinkhorn import sinkhorn_tokens_last
from model.residual.stream import (
    Connection,
    Fp32Parameters,
    ResidualStream,
    State,
    Sublayer,
    layer_index,
    per_layer_means,
)


def sinkhorn(logits: Tensor, iters: int, eps: float) -> Tensor:
    """transformers' recipe: softmax over the last axis + eps, a column step, then (iters - 1)
    row and column steps, every denominator + eps. logits (..., n, n) -> (..., n, n)."""
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


INIT_SCALE = 0.01  # Megatron-LM's mhc_init_gating_factor: the maps start near-uniform


def _flat_norm(x: Tensor, eps: float) -> Tensor:
    """The unweighted RMSNorm of the flattened streams, fp32: (B, T, n, C) -> (B, T, n C)."""
    flat = x.flatten(2).to(wide_dtype(x.dtype))
    return flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)


class HyperConnection(Connection, Fp32Parameters):
    """One sublayer's mHC map and update (transformers: DeepseekV4HyperConnection)."""

    def __init__(
        self, width: int, n: int, iters: int, eps: float, norm_eps: float, recompute: bool
    ):
        super().__init__()
        self.n, self.iters, self.eps, self.norm_eps, self.recompute = (
            n,
            iters,
            eps,
            norm_eps,
            recompute,
        )
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * width))
        self.base = nn.Parameter(torch.empty((2 + n) * n))
        self.scale = nn.Parameter(torch.empty(3))
        self.init_std = 0.02
        # what the last training forward did, for the metrics: written in place, so that a
        # compiled block keeps them (mean diagonal of comb, RMS of each stream, a written flag)
        self.register_buffer("last_diag", torch.zeros(()), persistent=False)
        self.register_buffer("last_rms", torch.zeros(n), persistent=False)
        self.register_buffer("recorded", torch.zeros(()), persistent=False)

    def param_roles(self) -> dict[str, str]:
        return {name: roles.MIXING for name in ("fn", "base", "scale")}  # AdamW, no decay

    def maps(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(pre (B, T, n), post (B, T, n), comb (B, T, n, n)), fp32."""
        n = self.n
        with torch.autocast(x.device.type, enabled=False):
            wide = wide_dtype(x.dtype)
            mixes = F.linear(_flat_norm(x, self.norm_eps), self.fn.to(wide))
            pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
            pre_b, post_b, comb_b = self.base.to(wide).split([n, n, n * n])
            s_pre, s_post, s_comb = self.scale.to(wide).unbind(0)
            pre = torch.sigmoid(pre_w * s_pre + pre_b) + self.eps
            post = 2 * torch.sigmoid(post_w * s_post + post_b)
            logits = comb_w.unflatten(-1, (n, n)) * s_comb + comb_b.view(n, n)
            if torch.compiler.is_compiling():  # Inductor fuses the recipe's loop
                return pre, post, sinkhorn(logits, self.iters, self.eps)
            return pre, post, sinkhorn_tokens_last(logits, self.iters, self.eps)

    def forward(self, x: Tensor, sublayer: Sublayer, norm: nn.Module) -> Tensor:
        if self.recompute and torch.is_grad_enabled():
            pre, post, comb = checkpoint(self.maps, x, use_reentrant=False)
        else:
            pre, post, comb = self.maps(x)
        if torch.is_grad_enabled():
            self._record(comb, x)
        collapsed = (pre.unsqueeze(-1) * x).sum(dim=2).to(x.dtype)  # (B, T, C)
        out = sublayer(norm(collapsed))
        mixed = torch.matmul(comb.to(x.dtype).transpose(-1, -2), x)  # sum_j comb_jk x_j
        return post.to(x.dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed

    @torch.no_grad()
    def _record(self, comb: Tensor, x: Tensor) -> None:
        """Small summaries only (keeping x would hold every stream until the next step)."""
        self.last_diag.copy_(comb.diagonal(dim1=-2, dim2=-1).mean())
        norms = torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32)  # (B, T, n), no fp32 copy
        self.last_rms.copy_(norms.square().mean(dim=(0, 1)).div(x.shape[-1]).sqrt())
        self.recorded.fill_(1.0)

    @torch.no_grad()
    def init_weights(self) -> None:
        nn.init.normal_(self.fn, std=self.init_std)
        nn.init.zeros_(self.base)
        nn.init.constant_(self.scale, INIT_SCALE)
        for buffer in (self.last_diag, self.last_rms, self.recorded):
            buffer.zero_()


class HyperHead(Fp32Parameters):
    """The learned collapse before the final norm (transformers: DeepseekV4HyperHead)."""

    def __init__(self, width: int, n: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(n, n * width))
        self.hc_base = nn.Parameter(torch.empty(n))
        self.hc_scale = nn.Parameter(torch.empty(1))
        self.init_std = 0.02

    def param_roles(self) -> dict[str, str]:
        return {name: roles.MIXING for name in ("hc_fn", "hc_base", "hc_scale")}

    def forward(self, x: Tensor) -> Tensor:
        with torch.autocast(x.device.type, enabled=False):
            wide = wide_dtype(x.dtype)
            mixes = F.linear(_flat_norm(x, self.norm_eps), self.hc_fn.to(wide))
            pre = torch.sigmoid(mixes * self.hc_scale.to(wide) + self.hc_base.to(wide)) + self.eps
            return (pre.unsqueeze(-1) * x).sum(dim=2).to(x.dtype)

    @torch.no_grad()
    def init_weights(self) -> None:
        nn.init.normal_(self.hc_fn, std=self.init_std)
        nn.init.zeros_(self.hc_base)
        nn.init.constant_(self.hc_scale, INIT_SCALE)


@RESIDUALS.register("mhc")
class ManifoldHyperConnections(ResidualStream):
    """The stream kind: n copies of the embedding in, a learned (or mean) collapse out."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        m = cfg.mhc
        self.n, self.width = m.streams, cfg.d_model
        learned = m.collapse == "learned"
        self.head = HyperHead(cfg.d_model, m.streams, m.eps, cfg.norm_eps) if learned else None
        if self.head is not None:
            self.head.init_std = cfg.init.std

    @classmethod
    def parallel_streams(cls, cfg: ModelConfig) -> int:
        return cfg.mhc.streams  # the state is (B, T, n, C)

    @classmethod
    def connection(cls, cfg: ModelConfig, layer_id: int, sublayer: str) -> Connection:
        m = cfg.mhc
        hc = HyperConnection(
            cfg.d_model, m.streams, m.sinkhorn_iters, m.eps, cfg.norm_eps, m.recompute_maps
        )
        hc.init_std = cfg.init.std
        return hc

    def expand(self, h: Tensor) -> State:
        return h.unsqueeze(2).expand(-1, -1, self.n, -1).contiguous()  # (B, T, n, C)

    def collapse(self, state: State) -> Tensor:
        return state.mean(dim=2) if self.head is None else self.head(state)

    stage_combine: ClassVar[dict[str, str]] = {"mhc/stream_spread": "max"}

    def boundary_shapes(self, layers: int, B: int, T: int) -> list[tuple[int, ...]]:
        return [(B, T, self.n, self.width)]

    def boundary_dtype(self, compute: torch.dtype) -> torch.dtype:
        """fp32: the connections compute in fp32 (Fp32Parameters; FSDP2 casts their inputs), so
        the n streams between blocks stay fp32 whatever the sublayers compute in."""
        return torch.float32

    def init_weights(self) -> None:
        if self.head is not None:
            self.head.init_weights()

    def flops_per_token(self) -> float:
        """Per sublayer, forward: the map z = RMSNorm(x) fn^T (2 (2 + n) n x n C), the mix
        comb^T x (2 n^2 C), the collapse and the expand (4 n C); the learned head's map and
        collapse (2 n x n C + 2 n C). The Sinkhorn steps on n x n are negligible."""
        n, C = self.n, self.width
        per_sublayer = 2 * (2 + n) * n * n * C + 2 * n * n * C + 4 * n * C
        head = 2 * n * n * C + 2 * n * C if self.head is not None else n * C
        return 2 * self.n_layers * per_sublayer + head

    def stats(self, model: nn.Module) -> dict[str, float]:
        """What the streams did in the last training forward (this rank's tokens), per layer
        (mean of its two sublayers) and overall:
          mhc/layer{i}/res_diag    mean diagonal of comb (1 = streams kept apart, 1/n = mixed)
          mhc/layer{i}/stream_rms  mean RMS of the streams entering the layer
          mhc/layer{i}/stream_spread  max / min stream RMS (1 = equal streams)"""
        layers, rows = [], []
        for name, module in model.named_modules():
            if isinstance(module, HyperConnection):
                diag, rms, done = module.last_diag, module.last_rms, module.recorded
                spread = rms.max() / rms.min().clamp_min(1e-12)
                rows.append(torch.stack([diag, rms.mean(), spread, done]))
                layers.append(layer_index(name))
        if not rows:
            return {}
        values = torch.stack(rows).tolist()  # one device sync
        if not all(row[3] == 1.0 for row in values):
            return {}  # no training forward yet (an evaluation-only model)
        out = per_layer_means("mhc", ("res_diag", "stream_rms", "stream_spread"), layers, values)
        out["mhc/res_diag"] = sum(r[0] for r in values) / len(values)
        out["mhc/stream_spread"] = max(r[2] for r in values)
        return out
