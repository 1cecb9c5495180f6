"""Parameter, FLOP, KV-cache and training-memory accounting, read off a (meta-device) model.

Conventions
- Parameters: `embedding` is the token table (+ learned positions); `head` the untied output head;
  `memory` Engram's n-gram tables (apart from the backbone's `blocks`; a token reads one row per
  hash head); `mtp` the multi-token-prediction modules (counted in `total`, as they train).
- MTP modules add their block, their 2C -> C projection and one more head matmul per depth to
  the training FLOPs.
  `active` counts what one token uses: all of it for dense models (the whole embedding table
  included); MoE layers subtract their unselected experts (`inactive_params_per_token`: E - k
  routed experts) and report the matmul weights a token passes through (`active_matmul_params`:
  router + shared experts + k routed experts), so FLOPs count active experts only.
- Training FLOPs per token = 6 x (matmul weights one token passes through, the head included, the
  embedding lookup not) + attention scores: each layer does 2 x H x (Dqk + Dv) multiply-adds per
  (query, key) pair in the forward (QK^T and AV), times 3 for forward + backward. With causal
  masking a query at index i sees i + 1 keys (or at most the sliding window), so the average
  context is (T + 1) / 2 for full causal attention, not T.
  Each token mixer reports its own part (`mixing_flops_per_token`, model/mixers/mixer.py); a residual
  stream with mixing of its own (Attention Residuals) reports it (`flops_per_token`).
- Generation state = sum over layers of what each mixer keeps (`state_size`): per token 2 x K x D
  for GQA/MHA/MQA, R + Dr for MLA, plus any fixed-size recurrent state; the MHA equivalent (every
  query head with its own key and value) is H x (Dqk + Dv) per attention layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from model.mixers.mixer import average_context  # noqa: F401  (re-exported; lives with the protocol)
from model.transformer import Transformer

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


@dataclass(frozen=True)
class ParamCounts:
    total: int
    embedding: int  # token embedding (+ learned position table)
    head: int  # untied output head; 0 when tied to the embedding
    blocks: int  # everything else: attention, FFN, norms (the backbone's blocks)
    active: int  # parameters one token uses
    memory: int = 0  # Engram's n-gram tables (role memory; a token reads a few rows)
    mtp: int = (
        0  # the multi-token-prediction modules (their own; the embedding and head are shared)
    )


def param_counts(model: Transformer) -> ParamCounts:
    total = sum(p.numel() for p in model.parameters())
    embedding = model.embed.weight.numel() + sum(p.numel() for p in model.pos.parameters())
    head = model.head.weight.numel() if model.head is not None else 0
    memory = sum(
        p.numel() for name, p in model.named_parameters() if name.endswith("engram.table.weight")
    )
    mtp = sum(p.numel() for p in model.mtp.parameters()) if model.mtp is not None else 0
    inactive = sum(
        m.inactive_params_per_token()
        for m in model.modules()
        if hasattr(m, "inactive_params_per_token")
    )
    return ParamCounts(
        total=total,
        embedding=embedding,
        head=head,
        blocks=total - embedding - head - memory - mtp,
        active=total - inactive,
        memory=memory,
        mtp=mtp,
    )


def matmul_params_per_token(module: nn.Module) -> int:
    """Weights of the matmuls one token goes through (modules may report their own, e.g. MoE)."""
    if hasattr(module, "active_matmul_params"):
        return module.active_matmul_params()
    if isinstance(module, nn.Linear):
        return module.weight.numel()
    return sum(matmul_params_per_token(child) for child in module.children())


@dataclass(frozen=True)
class FlopsPerToken:
    matmul: float  # 6 x matmul weights (forward 2, backward 4)
    attention: float  # 6 x sum over layers of H (Dqk + Dv) x average context
    seq_len: int
    residual: float = 0.0  # 3 x the residual stream's own mixing (Attention Residuals, mHC)

    @property
    def total(self) -> float:
        return self.matmul + self.attention + self.residual

    @property
    def forward(self) -> float:
        return self.total / 3


def training_flops_per_token(model: Transformer, seq_len: int) -> FlopsPerToken:
    """The whole training step's, MTP modules included (each also runs the head once) unless
    their lambda is 0 for the whole run (then they are skipped)."""
    mtp = model.mtp if model.mtp is not None and _mtp_runs(model.cfg) else None
    matmul = sum(matmul_params_per_token(block) for block in model.layers.values())
    heads = 1 + (len(mtp.layers) if mtp is not None else 0)
    matmul += heads * model.head_weight.numel()  # the head is a matmul even when tied
    blocks = list(model.layers.values())
    if mtp is not None:
        matmul += sum(matmul_params_per_token(module) for module in mtp.layers)
        blocks += [module.block for module in mtp.layers]
    mixing = sum(block.attn.mixing_flops_per_token(seq_len) for block in blocks)
    stream = model.stream.flops_per_token()
    return FlopsPerToken(
        matmul=6.0 * matmul, attention=3.0 * mixing, seq_len=seq_len, residual=3.0 * stream
    )


def _mtp_runs(cfg) -> bool:
    return cfg.mtp.weight > 0 or cfg.mtp.final_weight > 0


@dataclass(frozen=True)
class KVCacheSize:
    bytes_per_token: int  # per-token caches (KV, latent)
    mha_bytes_per_token: int  # the same attention layers with one key and value per query head
    fixed_bytes: int = 0  # per sequence whatever its length (recurrent states)

    @property
    def reduction(self) -> float:
        return self.mha_bytes_per_token / self.bytes_per_token if self.bytes_per_token else 0.0

    def per_sequence(self, tokens: int) -> int:
        return self.bytes_per_token * tokens + self.fixed_bytes


def kv_cache_size(model: Transformer, dtype: str = "bf16") -> KVCacheSize:
    """Generation-state bytes per token (and fixed per sequence), summed over the layers."""
    width = DTYPE_BYTES[dtype]
    sizes = [block.attn.state_size() for block in model.layers.values()]
    return KVCacheSize(
        bytes_per_token=sum(s.per_token for s in sizes) * width,
        mha_bytes_per_token=sum(s.mha_per_token for s in sizes) * width,
        fixed_bytes=sum(s.fixed * width + s.fixed_fp32 * 4 for s in sizes),
    )


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes for weights, gradients, fp32 master copy and AdamW's two fp32 moments."""

    weights: int
    grads: int
    master: int
    optimizer: int
    shards: int  # data-parallel ranks these states are sharded over (FSDP)

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.master + self.optimizer

    @property
    def per_device(self) -> float:
        return self.total / self.shards


def training_memory(n_params: int, param_dtype: str = "fp32", shards: int = 1) -> TrainingMemory:
    """AdamW training state. param_dtype fp32: 4 + 4 + 8 bytes/param (FSDP2 keeps fp32 sharded
    params and grads even when computing in bf16); bf16: 2 + 2 + a 4-byte fp32 master + 8."""
    width = DTYPE_BYTES[param_dtype]
    master = 4 * n_params if width < 4 else 0
    return TrainingMemory(
        weights=width * n_params,
        grads=width * n_params,
        master=master,
        optimizer=8 * n_params,
        shards=shards,
    )
