"""Gated DeltaNet (layer kind "gdn"): a linear-time delta-rule token mixer (Qwen3-Next / Qwen3.5).

Shapes: B batch, T new tokens, C d_model, Hk query/key heads, H value heads (H / Hk consecutive
value heads share a key head), Dk / Dv head dims, K conv kernel.

    q, k, v = W_q x, W_k x, W_v x           (B, T, Hk Dk), (B, T, Hk Dk), (B, T, H Dv)
    q, k, v = SiLU(causal depthwise conv_K([q | k | v]))   restarting at every document start
    q, k    = L2-normalized per head (q also x Dk^-1/2), repeated to the H value heads
    beta    = sigmoid(W_b x) (x 2 with allow_neg_eigval)                      (B, T, H)
    g       = -exp(A_log) softplus(W_a x + dt_bias), in fp32 (log-decay <= 0)  (B, T, H)
    o       = gated delta rule (model/mixers/delta_rule.py): chunked for T > 1, recurrent for decoding
    out     = W_o (RMSNorm(o) * SiLU(W_z x))                   the gated norm per value head

Generation keeps a fixed-size `RecurrentState`: the conv's last K-1 inputs and the (H, Dk, Dv)
delta-rule state, whatever the context length.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model import roles
from model.config import ConfigError, GDNConfig, ModelConfig
from model.init import InitStds, init_linear, trunc_normal_
from model.mixers.delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from model.mixers.fla_ops import fla_gated_delta_rule, use_fla
from model.mixers.kv_cache import RecurrentState
from model.mixers.masks import AttentionContext
from model.mixers.mixer import LayerDims, StateSize, TokenMixer
from model.norms import GatedRMSNorm, wide_dtype
from model.registry import MIXERS

DT_MIN, DT_MAX = 1e-3, 1e-1  # initial time steps softplus(dt_bias), log-uniform (FLA, OLMo)
A_MIN, A_MAX = 0.01, 16.0  # initial decay rates exp(A_log), uniform (Qwen3-Next)


def causal_conv(
    x: Tensor, weight: Tensor, past: Tensor | None, positions: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Depthwise causal convolution: x (B, T, D), weight (D, K) -> (y (B, T, D), the last K-1
    inputs (B, K-1, D)). `past` (B, K-1, D): the inputs before x (zeros when None). With
    `positions` (B, T) (within-document), a tap never reaches into an earlier document."""
    B, T, D = x.shape
    K = weight.shape[1]
    if past is None:
        past = x.new_zeros(B, K - 1, D)
    full = torch.cat([past.to(x.dtype), x], dim=1)  # (B, K-1+T, D)
    wide = wide_dtype(x.dtype)  # taps summed in fp32, like nn.Conv1d
    y = x.new_zeros(B, T, D, dtype=wide)
    for i in range(K):  # tap i reads the input K-1-i steps back
        tap = full[:, i : i + T].to(wide) * weight[:, i].to(wide)
        if positions is not None:
            tap = tap * (positions >= K - 1 - i).to(wide)[..., None]
        y = y + tap
    return y.to(x.dtype), full[:, T:]


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The delta rule's compute and state dtype: fp32, or the model's when wider (fp64 tests)."""
    return wide_dtype(dtype)


def delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial: Tensor | None,
    ctx: AttentionContext,
    chunk: int,
    state: RecurrentState | None,
    kernel: str = "torch",
) -> tuple[Tensor, Tensor]:
    """The recurrent form for one decoded token (T == 1 with a state), else the chunked one; on
    fla-core's Triton kernels when `kernel` ("auto" | "torch" | "fla") picks them
    (model/mixers/fla_ops.py), else in torch (model/mixers/delta_rule.py)."""
    if ctx.context_parallel is not None:  # segments on every context-parallel rank
        return ctx.context_parallel.delta_rule(q, k, v, g, beta, ctx.doc_starts, chunk)
    decoding = state is not None and q.shape[2] == 1
    if use_fla(kernel, q):
        return fla_gated_delta_rule(q, k, v, g, beta, initial, None if decoding else ctx.doc_starts)
    if decoding:
        return recurrent_gated_delta_rule(q, k, v, g, beta, initial)
    return chunk_gated_delta_rule(q, k, v, g, beta, initial, ctx.doc_starts, chunk)


def conv_qkv(
    layer: nn.Module, x: Tensor, ctx: AttentionContext, state: RecurrentState | None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """SiLU(causal conv([W_q x | W_k x | W_v x])) of a delta-rule layer, split back into q, k
    (B, T, Hk Dk) and v (B, T, H Dv), restarting at documents and continuing `state`'s conv
    inputs; and the last K-1 inputs. Widths as projected: under tensor parallelism, this
    rank's heads (and their conv channels)."""
    parts = [layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)]
    positions = ctx.positions if ctx.doc_starts is not None else None
    past = state.conv if state is not None else None
    x, weight = torch.cat(parts, -1), layer.conv.weight[:, 0]
    if ctx.context_parallel is not None:  # each chunk continuing the one before it

        def conv(chunk: Tensor, before: Tensor, where: Tensor | None) -> Tensor:
            return causal_conv(chunk, weight, before, where)[0]

        mixed = ctx.context_parallel.convolve(conv, x, weight.shape[1] - 1, positions)
        last_inputs = None
    else:
        mixed, last_inputs = causal_conv(x, weight, past, positions)
    q, k, v = F.silu(mixed).split([t.shape[-1] for t in parts], dim=-1)
    return q, k, v, last_inputs


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (FLA's convention)."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


class DeltaRuleMixer(TokenMixer):
    """What Gated DeltaNet and KDA share: decay parameters, the short conv, and a fixed-size
    generation state (subclasses set n_heads, k_dim, v_dim, conv, A_log, dt_bias)."""

    n_heads: int
    k_dim: int
    v_dim: int

    def param_roles(self) -> dict[str, str]:
        return {"A_log": roles.DECAY, "dt_bias": roles.DECAY}

    def float8_exclusions(self) -> dict[str, str]:
        """The gate projections that stay in the compute dtype under trainer.precision=float8
        (model/float8_filter.py): the decay's (Gated DeltaNet's a_proj, KDA's low-rank forget gate)
        and the write strength beta (b_proj), whose errors compound over the recurrence."""
        gates = ("a_proj", "f_a_proj", "f_b_proj", "b_proj")
        reason = "recurrent decay / write-strength gate (error compounds over time)"
        return {name: reason for name in gates if hasattr(self, name)}

    def init_conv_and_decay(self, a_min: float, a_max: float) -> None:
        """Conv taps std 1/sqrt(K); exp(A_log) ~ U(a_min, a_max); softplus(dt_bias) log-uniform
        in [DT_MIN, DT_MAX]."""
        trunc_normal_(self.conv.weight, 1.0 / math.sqrt(self.conv.weight.shape[-1]))
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(a_min, a_max).log())
        dt = torch.empty_like(self.dt_bias).uniform_(math.log(DT_MIN), math.log(DT_MAX)).exp()
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)

    def run_rule(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        ctx: AttentionContext,
        state: RecurrentState | None,
        last_inputs: Tensor,
        out_dtype: torch.dtype,
    ) -> Tensor:
        """The delta rule on the prepared (B, H, T, .) inputs, its matmuls in fp32 outside
        autocast, continuing and then updating `state` (conv inputs and the rule's state);
        o (B, T, H, Dv) in `out_dtype`."""
        initial = state.state if state is not None else None
        with torch.autocast(q.device.type, enabled=False):
            o, final = delta_rule(q, k, v, g, beta, initial, ctx, self.chunk, state, self.kernel)
        if state is not None:
            state.conv.copy_(last_inputs)
            state.state.copy_(final)
        return o.transpose(1, 2).to(out_dtype)

    def state_size(self) -> StateSize:
        """Fixed per sequence: the conv's K-1 inputs and the fp32 delta-rule state."""
        conv_dim, K = self.conv.weight.shape[0], self.conv.weight.shape[-1]
        return StateSize(
            per_token=0,
            fixed=conv_dim * (K - 1),
            fixed_fp32=self.n_heads * self.k_dim * self.v_dim,
        )

    def new_state(
        self, batch: int, capacity: int, dtype: torch.dtype, device: torch.device
    ) -> RecurrentState:
        # this rank's heads and their conv channels (tensor parallelism splits every block of
        # [q | k | v] and the value heads evenly; the conv weight stays whole on every rank)
        tp = self.tensor_parallel_degree
        conv_dim, K = self.conv.weight.shape[0] // tp, self.conv.weight.shape[-1]
        shape = (batch, self.local_heads(self.n_heads), self.k_dim, self.v_dim)
        return RecurrentState(
            torch.zeros(batch, K - 1, conv_dim, dtype=dtype, device=device),
            torch.zeros(shape, dtype=state_dtype(dtype), device=device),
        )


@MIXERS.register("gdn")
class GatedDeltaNet(DeltaRuleMixer):
    kind = "gdn"

    @classmethod
    def check(cls, cfg: ModelConfig) -> None:
        if cfg.position not in ("rope", "none"):
            raise ConfigError(
                f"model.position={cfg.position!r}: gdn layers take no position encoding of their "
                "own; use rope (applied in the attention layers) or none"
            )

    @classmethod
    def build(cls, cfg: ModelConfig, layer_id: int = 0) -> GatedDeltaNet:
        return cls(cfg.gdn, LayerDims.of(cfg))

    def __init__(self, g: GDNConfig, dims: LayerDims) -> None:
        super().__init__()
        self.n_k_heads, self.n_heads = g.n_heads, g.n_v_heads or g.n_heads
        self.k_dim, self.v_dim = g.head_dim, g.v_head_dim or g.head_dim
        self.chunk, self.neg_eigval = g.chunk_size, g.allow_neg_eigval
        self.kernel = g.kernel  # auto | torch | fla (model/mixers/fla_ops.py)
        C, H = dims.d_model, self.n_heads
        key_width, value_width = self.n_k_heads * self.k_dim, H * self.v_dim
        self.q_proj = nn.Linear(C, key_width, bias=False)
        self.k_proj = nn.Linear(C, key_width, bias=False)
        self.v_proj = nn.Linear(C, value_width, bias=False)
        self.z_proj = nn.Linear(C, value_width, bias=False)  # the output gate
        self.b_proj = nn.Linear(C, H, bias=False)  # beta
        self.a_proj = nn.Linear(C, H, bias=False)  # the time step of the decay
        self.conv = nn.Conv1d(
            2 * key_width + value_width,
            2 * key_width + value_width,
            g.conv_kernel,
            groups=2 * key_width + value_width,
            bias=False,
        )
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(H))
        self.norm = GatedRMSNorm(self.v_dim, dims.norm_eps)
        self.o_proj = nn.Linear(value_width, C, bias=False)

    def forward(
        self, x: Tensor, ctx: AttentionContext, state: RecurrentState | None = None
    ) -> Tensor:
        B, T, _ = x.shape
        Dk, Dv = self.k_dim, self.v_dim
        # -1 below: the heads this rank holds (all, or its share under tensor parallelism)
        q, k, v, last_inputs = conv_qkv(self, x, ctx, state)
        group = self.n_heads // self.n_k_heads
        dt = state_dtype(x.dtype)  # the rule runs in fp32 (fp64 for fp64 models)
        q = l2_normalize(q.to(dt).view(B, T, -1, Dk)) * Dk**-0.5
        k = l2_normalize(k.to(dt).view(B, T, -1, Dk))
        q, k = (t.repeat_interleave(group, dim=2).transpose(1, 2) for t in (q, k))  # (B, H, T, Dk)
        v_heads = v.to(dt).view(B, T, -1, Dv).transpose(1, 2)
        beta = torch.sigmoid(self.b_proj(x).to(dt)) * (2.0 if self.neg_eigval else 1.0)
        g = -self.A_log.to(dt).exp() * F.softplus(self.a_proj(x).to(dt) + self.dt_bias.to(dt))
        beta, g = beta.transpose(1, 2), g.transpose(1, 2)  # (B, H, T)
        o = self.run_rule(q, k, v_heads, g, beta, ctx, state, last_inputs, v.dtype)
        gate = self.z_proj(x).view(B, T, -1, Dv)
        return self.o_proj(self.norm(o, gate).reshape(B, T, -1))

    def tensor_parallel_plan(self, tp: int) -> dict[str, object]:
        """Heads split over `tp` ranks (parallel/tensor_parallel.py): the q, k, v projections,
        the output gate z and the per-head beta and time-step projections column-wise; the
        conv's channels over [q | k | v], A_log and dt_bias by the same heads ("head_rows":
        small, whole on every rank, each computing with its heads' rows); the gated norm's gain
        (one per value dim, shared by the heads) whole with its gradient summed; the output
        projection row-wise. Value head h uses key head h // (H / Hk) locally too, since tp
        divides both head counts."""
        Hk, H, Dk, Dv = self.n_k_heads, self.n_heads, self.k_dim, self.v_dim
        if Hk % tp or H % tp:
            raise ConfigError(
                f"parallel.tp={tp} must divide the gdn layers' {Hk} query/key and {H} value "
                "heads (model.gdn.n_heads, n_v_heads)"
            )
        plan: dict[str, object] = {
            name: "colwise" for name in ("q_proj", "k_proj", "v_proj", "z_proj", "b_proj", "a_proj")
        }
        return plan | {
            "conv.weight": ("head_rows", ((Hk, Dk), (Hk, Dk), (H, Dv))),
            "A_log": ("head_rows", ((H, 1),)),
            "dt_bias": ("head_rows", ((H, 1),)),
            "norm": "head_shared",
            "o_proj": "rowwise",
        }

    @torch.no_grad()
    def init_weights(self, stds: InitStds) -> None:
        for linear in (self.q_proj, self.k_proj, self.z_proj, self.b_proj, self.a_proj):
            init_linear(linear, stds.inner)
        init_linear(self.v_proj, stds.value)
        init_linear(self.o_proj, stds.out)
        self.init_conv_and_decay(A_MIN, A_MAX)
        self.norm.init_weights()

    # ---- accounting and generation ------------------------------------------------------------

    def mixing_flops_per_token(self, seq_len: int) -> float:
        """The chunked form's matmuls per token and value head, forward: K_beta K^T and Q K^T
        (2 C Dk), the two triangular solves (C (Dk + Dv) / 2), the intra-chunk product (C Dv),
        reading, correcting and writing the state (3 Dk Dv); plus the conv (K per channel)."""
        C, Dk, Dv = min(self.chunk, seq_len), self.k_dim, self.v_dim
        per_head = 2 * C * Dk + C * (Dk + Dv) / 2 + C * Dv + 3 * Dk * Dv
        conv = self.conv.weight.shape[0] * self.conv.weight.shape[-1]
        return 2.0 * (self.n_heads * per_head + conv)

    def describe(self) -> str:
        return (
            f"GDN: {self.n_k_heads} qk x {self.k_dim}, {self.n_heads} v x {self.v_dim}, "
            f"conv {self.conv.weight.shape[-1]}"
        )
