"""Attention Residuals (Kimi, arXiv 2603.15031; `model.residual=attnres`): every sublayer reads a
softmax over depth of the earlier sources instead of their plain sum.

Shapes: B batch, T tokens, C d_model, N sources. Sublayers are the attention and the FFN of each
layer (2L in all). For sublayer l with its pseudo-query w_l (C,) and key-norm gain g_l (C,), both
fp32, w_l zero-initialized:

    h_l = sum_n alpha_n v_n,   alpha = softmax_n( w_l . RMSNorm_{g_l}(v_n) )   (no 1/sqrt(C))

over the sources v_n (B, T, C) (values unnormalized), then f_l(norm(h_l)) as in pre-norm. A last
aggregation with its own query feeds the final norm.

Sources (`attnres.block_layers` = k):
  k = 0 (Full AttnRes)  the embedding and every earlier sublayer output;
  k > 0 (Block AttnRes) layers in blocks of k: the embedding b_0, the completed block sums
        b_1 .. b_{n-1} and the running sum of the current block. A block starts at the attention
        sublayer of layer l (1-based) when (l - 1) % k == 0, so the first sublayer of a block sees
        only completed blocks, and the head sees floor((L - 1) / k) + 2 sources (Megatron-LM's
        bookkeeping of the reference pseudocode).
The stream state is (completed sources: a `DepthSources`, running sum or None). The completed
sources sit in an opaque object, not a tuple, so that FSDP2 sees only the running sum as a block's
input and output: a source passed through a block as a tensor output would take that block's
backward hooks (FSDP2 would reshard or reduce its gradients while later blocks still send
gradient through them: wrong gradients, tested on 2 ranks). With zero queries every
alpha is 1/N, h_l is the pre-norm stream divided by N, and RMSNorm removes the scale: at
initialization the model computes what the pre-norm model with the same sublayer weights does.

The aggregation is one autograd Function in fp32 that saves only per-token statistics (N, B, T)
beside the sources themselves (already kept by the sublayers) and recomputes the rest in
backward, instead of autograd's fp32 copies of every normalized source per sublayer.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from model import roles
from model.config import ModelConfig
from model.norms import wide_dtype
from model.registry import RESIDUALS
from model.residual.stream import (
    Connection,
    Fp32Parameters,
    ResidualStream,
    State,
    Sublayer,
    layer_index,
    per_layer_means,
)


class _DepthAttention(torch.autograd.Function):
    """h = sum_n softmax_n((v_n . q) rstd_n) v_n with q = w * g and rstd_n = rsqrt(mean v_n^2 + eps)
    (the same as w . RMSNorm_g(v_n)), in fp32; sources in their own dtype."""

    @staticmethod
    def forward(ctx, query: Tensor, gain: Tensor, eps: float, *sources: Tensor) -> Tensor:
        wide = wide_dtype(sources[0].dtype)
        with torch.autocast(sources[0].device.type, enabled=False):
            q = query.to(wide) * gain.to(wide)
            dot = torch.stack([(v.to(wide) * q).sum(-1) for v in sources])  # (N, B, T)
            rstd = torch.stack([torch.rsqrt(v.to(wide).square().mean(-1) + eps) for v in sources])
            alpha = torch.softmax(dot * rstd, dim=0)
            h = alpha[0, ..., None] * sources[0].to(wide)
            for n in range(1, len(sources)):
                h = h + alpha[n, ..., None] * sources[n].to(wide)
        ctx.eps = eps
        ctx.save_for_backward(query, gain, alpha, dot, rstd, *sources)
        ctx.mark_non_differentiable(alpha)
        return h.to(sources[0].dtype), alpha

    @staticmethod
    @once_differentiable  # alpha, dot and rstd are saved as constants: no double backward
    def backward(ctx, grad: Tensor, _: Tensor | None = None) -> tuple[Tensor | None, ...]:
        query, gain, alpha, dot, rstd, *sources = ctx.saved_tensors
        wide = wide_dtype(grad.dtype)
        with torch.autocast(grad.device.type, enabled=False):
            q, dh = query.to(wide) * gain.to(wide), grad.to(wide)
            width = dh.shape[-1]
            dalpha = torch.stack([(dh * v.to(wide)).sum(-1) for v in sources])  # (N, B, T)
            dlogit = alpha * (dalpha - (alpha * dalpha).sum(0, keepdim=True))  # softmax backward
            dq = torch.zeros_like(q)
            grads = []
            for n, v in enumerate(sources):
                v32, r, dl = v.to(wide), rstd[n, ..., None], dlogit[n, ..., None]
                # logit = (v . q) rstd(v), d rstd / dv = -rstd^3 v / C
                dv = alpha[n, ..., None] * dh + dl * (
                    q * r - (dot[n, ..., None] * r**3 / width) * v32
                )
                grads.append(dv.to(v.dtype))
                dq = dq + (dl * r * v32).reshape(-1, width).sum(0)
        dquery, dgain = dq * gain.to(wide), dq * query.to(wide)
        return dquery.to(query.dtype), dgain.to(gain.dtype), None, *grads


def depth_attention(sources: list[Tensor], query: Tensor, gain: Tensor, eps: float) -> Tensor:
    """The aggregation over `sources` (each (B, T, C)) for one pseudo-query (see the module doc)."""
    return _DepthAttention.apply(query, gain, eps, *sources)[0]


def reference_depth_attention(
    sources: list[Tensor], query: Tensor, gain: Tensor, eps: float
) -> Tensor:
    """The obvious form through autograd (tests): keys = RMSNorm_g(v), softmax over depth."""
    wide = wide_dtype(sources[0].dtype)
    V = torch.stack([v.to(wide) for v in sources])  # (N, B, T, C)
    keys = V * torch.rsqrt(V.square().mean(-1, keepdim=True) + eps) * gain.to(wide)
    alpha = torch.softmax((keys * query.to(wide)).sum(-1), dim=0)
    return (alpha[..., None] * V).sum(0).to(sources[0].dtype)


class DepthQuery(Fp32Parameters):
    """One aggregation's parameters: the pseudo-query (zeros) and the key-norm gain (ones), fp32."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.zeros(width))
        self.gain = nn.Parameter(torch.ones(width))
        self.eps = eps
        self.last_weights: Tensor | None = None  # alpha (N,) over the last training forward

    def param_roles(self) -> dict[str, str]:
        return {"query": roles.MIXING, "gain": roles.GAIN}  # AdamW, no weight decay, never Muon

    def forward(self, sources: list[Tensor]) -> Tensor:
        h, alpha = _DepthAttention.apply(self.query, self.gain, self.eps, *sources)
        if torch.is_grad_enabled() and not torch.compiler.is_compiling():
            self.last_weights = alpha.detach().mean(dim=(1, 2))  # (N,) for the metrics
        return h

    @torch.no_grad()
    def init_weights(self) -> None:
        self.query.zero_()
        self.gain.fill_(1.0)


class DepthSources:
    """The completed sources (an immutable tuple of (B, T, C) tensors) as one opaque value: pytrees,
    FSDP2's hooks and activation checkpointing pass it through without touching its tensors."""

    __slots__ = ("tensors",)

    def __init__(self, tensors: tuple[Tensor, ...] = ()) -> None:
        self.tensors = tensors

    def plus(self, source: Tensor) -> DepthSources:
        return DepthSources((*self.tensors, source))


class AttnResConnection(Connection):
    """One sublayer: (completed sources, running sum) -> the same with this sublayer's output."""

    def __init__(self, width: int, eps: float, starts_block: bool, full: bool) -> None:
        super().__init__()
        self.depth = DepthQuery(width, eps)
        self.starts_block, self.full = starts_block, full

    def forward(self, state: State, sublayer: Sublayer, norm: nn.Module) -> State:
        completed, partial = state
        if (self.full or self.starts_block) and partial is not None:
            completed, partial = completed.plus(partial), None
        sources = [*completed.tensors, *(() if partial is None else (partial,))]
        out = sublayer(norm(self.depth(sources)))
        if partial is None:  # a new running sum, kept in the stream's dtype (fp32 under autocast)
            return completed, out.to(completed.tensors[0].dtype)
        return completed, partial + out

    def init_weights(self) -> None:
        self.depth.init_weights()


@RESIDUALS.register("attnres")
class AttentionResiduals(ResidualStream):
    """The stream kind: the embedding as the first source; a final aggregation before the norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.head = DepthQuery(cfg.d_model, cfg.norm_eps)  # the last aggregation's query
        self.width, self.block_layers = cfg.d_model, cfg.attnres.block_layers

    @classmethod
    def parallel_streams(cls, cfg: ModelConfig) -> None:
        return None  # the state is the earlier sublayers' outputs, not a hidden state

    @classmethod
    def connection(cls, cfg: ModelConfig, layer_id: int, sublayer: str) -> Connection:
        k = cfg.attnres.block_layers
        starts = sublayer == "attn" and k > 0 and layer_id % k == 0  # layer_id is 0-based
        return AttnResConnection(cfg.d_model, cfg.norm_eps, starts, full=k == 0)

    def expand(self, h: Tensor) -> State:
        return DepthSources(), h  # the embedding: the running sum until the first block start

    def collapse(self, state: State) -> Tensor:
        completed, partial = state
        return self.head([*completed.tensors, *(() if partial is None else (partial,))])

    def to_tensors(self, state: State) -> tuple[Tensor, ...]:
        """The completed sources, then the running sum (never None between blocks)."""
        completed, partial = state
        return (*completed.tensors, partial)

    def from_tensors(self, tensors: tuple[Tensor, ...]) -> State:
        return DepthSources(tuple(tensors[:-1])), tensors[-1]

    def boundary_shapes(self, layers: int, B: int, T: int) -> list[tuple[int, ...]]:
        """After `layers` blocks: the completed sources and the running sum, each (B, T, C)."""
        counts = self.source_counts()  # a sublayer's count is its inputs: the state before it
        sources = counts[2 * layers] if layers < self.n_layers else counts[-1]
        return [(B, T, self.width)] * sources

    def init_weights(self) -> None:
        self.head.init_weights()

    def flops_per_token(self) -> float:
        """Per aggregation over N sources of width C: the dot with the query, the squares for the
        RMS and the weighted sum, 2 C each per source (6 N C); summed over the 2L sublayers and
        the head (the softmax over N is negligible)."""
        counts = self.source_counts()
        return 6.0 * self.width * sum(counts)

    def source_counts(self) -> list[int]:
        """N of every aggregation in order: each sublayer's, then the head's."""
        L, k = self.n_layers, self.block_layers
        counts, completed, partial = [], 0, True  # the embedding starts as the running sum
        for layer in range(L):
            for sublayer in ("attn", "ffn"):
                if (k == 0 or (sublayer == "attn" and layer % k == 0)) and partial:
                    completed, partial = completed + 1, False
                counts.append(completed + partial)
                partial = True
        return [*counts, completed + partial]

    compile_whole_blocks = False  # the source count differs per block: compile the sublayers

    def stats(self, model: nn.Module) -> dict[str, float]:
        """What the depth weights of the last training forward (this rank's tokens) do, per layer
        (mean of its two sublayers) and overall:
          attnres/layer{i}/entropy       entropy of alpha over the sources / log(sources) (1 = uniform;
                                         aggregations over one source are left out)
          attnres/layer{i}/embed_weight  alpha on the embedding (the first source)
          attnres/entropy, attnres/embed_weight, attnres/head_embed_weight (the final aggregation)"""
        layers, summaries = [], []
        for name, module in model.named_modules():
            weights = module.depth.last_weights if isinstance(module, AttnResConnection) else None
            if weights is not None and weights.numel() > 1:
                layers.append(layer_index(name))
                summaries.append(_summary(weights))
        if not summaries:
            return {}
        head = self.head.last_weights if self.head is not None else None  # (a first stage)
        if head is not None and head.numel() > 1:
            summaries.append(_summary(head))
        values = torch.stack(summaries).tolist()  # one device sync for all of them
        rows = values[: len(layers)]
        out = per_layer_means("attnres", ("entropy", "embed_weight"), layers, rows)
        out["attnres/entropy"] = sum(r[0] for r in rows) / len(rows)
        out["attnres/embed_weight"] = sum(r[1] for r in rows) / len(rows)
        if len(values) > len(layers):
            out["attnres/head_embed_weight"] = values[-1][1]
        return out


def _summary(alpha: Tensor) -> Tensor:
    """[normalized entropy, weight on the first source] of one aggregation's alpha (N > 1,)."""
    entropy = -(alpha * alpha.clamp_min(1e-12).log()).sum() / math.log(alpha.numel())
    return torch.stack([entropy.float(), alpha[0].float()])


def head_sources(n_layers: int, block_layers: int) -> int:
    """Sources the final aggregation sees: 2L + 1 (Full), floor((L - 1) / k) + 2 (Block)."""
    if block_layers == 0:
        return 2 * n_layers + 1
    return math.floor((n_layers - 1) / block_layers) + 2
