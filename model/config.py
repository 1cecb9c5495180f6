"""Model configuration: one small dataclass per component, validated on construction.

Integers use 0 for "derive it" (documented per field) so that the same dataclasses work as Hydra
structured configs. Errors name the field, the value and the rule, with the `model.` prefix that the
Hydra override would use.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from typing import Any, TypeVar

from model.errors import ConfigError
from model.registry import (
    ATTENTIONS,
    FFNS,
    MIXERS,
    NORMS,
    POSITIONS,
    RESIDUALS,
    ROPE_PAIRINGS,
    ROPE_SCALINGS,
    Registry,
)

DEPTH_SCALINGS = ("none", "total", "layer")
SCORE_FUNCS = ("softmax", "sigmoid")  # MoE router scoring (model/moe/router.py)
GATED_FFNS = ("swiglu", "geglu")  # FFN kinds with a gate projection (MoE experts are gated)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _check_choice(key: str, value: str, registry: Registry) -> None:
    _require(
        value in registry,
        f"{key}={value!r} is not a known {registry.what}; choose one of: {', '.join(registry.names())}",
    )


def check_rotary_dim(rope: RopeConfig, rotary_dim: int, source: str) -> None:
    """NTK scalings raise the base to R/(R-2): they need more than 2 rotary dims per head."""
    _require(
        rope.scaling not in ("ntk", "dynamic_ntk") or rotary_dim > 2,
        f"model.rope.scaling={rope.scaling!r} needs more than 2 rotary dims per head "
        f"(the base exponent is R/(R-2)); {source} = {rotary_dim}",
    )


@dataclass(frozen=True)
class LayerSpec:
    """One resolved layer of the stack."""

    index: int
    mixer: str  # MIXERS key (gqa, mla, ...)
    ffn: str  # dense | moe


@dataclass(kw_only=True)
class RopeConfig:
    """Rotary position embedding and its context-extension variants."""

    theta: float = 10000.0  # base of the geometric frequency ladder
    # "half": (i, i+d/2) pairs (HF/NeoX); "interleaved": (2i, 2i+1) (Meta, DeepSeek)
    pairing: str = "half"
    # fraction of each head's dims that rotate (partial rotary); the rest pass through
    fraction: float = 1.0
    scaling: str = "none"  # none | linear | ntk | dynamic_ntk | yarn | llama3
    factor: float = 1.0  # context-extension factor s (new length / original length)
    # pretraining context for yarn/dynamic_ntk/llama3; 0 = model.max_seq_len
    original_max_seq_len: int = 0
    beta_fast: float = 32.0  # YaRN: rotations above which a dim is extrapolated (kept as is)
    beta_slow: float = 1.0  # YaRN: rotations below which a dim is fully interpolated (divided by s)
    mscale: float = 0.0  # YaRN (DeepSeek form): cos/sin temperature numerator weight; 0 = unset
    mscale_all_dim: float = 0.0  # YaRN (DeepSeek form): softmax temperature weight; 0 = unset
    attention_factor: float = 0.0  # YaRN: explicit cos/sin factor; 0 = 0.1*ln(s)+1 (the paper's)
    low_freq_factor: float = 1.0  # llama3: wavelengths above original/low are divided by s
    high_freq_factor: float = 4.0  # llama3: wavelengths below original/high are kept

    def __post_init__(self) -> None:
        _check_choice("model.rope.pairing", self.pairing, ROPE_PAIRINGS)
        _check_choice("model.rope.scaling", self.scaling, ROPE_SCALINGS)
        _require(self.theta > 1, f"model.rope.theta={self.theta} must be > 1")
        _require(
            0 < self.fraction <= 1,
            f"model.rope.fraction={self.fraction} must be in (0, 1] (the share of head dims that rotate)",
        )
        if self.scaling != "none":
            _require(
                self.factor >= 1,
                f"model.rope.factor={self.factor} must be >= 1 for rope.scaling={self.scaling!r}",
            )
        _require(
            self.beta_fast > self.beta_slow,
            f"model.rope.beta_fast={self.beta_fast} must exceed model.rope.beta_slow={self.beta_slow}",
        )
        _require(
            self.high_freq_factor > self.low_freq_factor,
            f"model.rope.high_freq_factor={self.high_freq_factor} must exceed "
            f"model.rope.low_freq_factor={self.low_freq_factor}",
        )
        _require(
            self.original_max_seq_len >= 0,
            f"model.rope.original_max_seq_len={self.original_max_seq_len} must be >= 0 (0 = max_seq_len)",
        )


@dataclass(kw_only=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3) dimensions."""

    q_lora_rank: int = 0  # rank of the query bottleneck; 0 = a full-rank query projection
    kv_lora_rank: int = 512  # width of the joint K/V latent (what the KV cache stores)
    qk_nope_head_dim: int = 128  # per-head query/key dims without position
    qk_rope_head_dim: int = 64  # per-head query dims with RoPE; the rope key is shared by all heads
    v_head_dim: int = 128  # per-head value dims
    # NoPE: the rope part of queries and the shared key is not rotated (Kimi Linear's full
    # layers; order then comes from the causal mask and the linear layers)
    nope: bool = False
    norm_eps: float = 0.0  # eps of the q/kv latent RMSNorms; 0 = model.norm_eps (HF's: 1e-6)

    def __post_init__(self) -> None:
        _require(self.norm_eps >= 0, f"model.attention.mla.norm_eps={self.norm_eps} must be >= 0")
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            _require(value > 0, f"model.attention.mla.{name}={value} must be > 0")
        _require(
            self.q_lora_rank >= 0,
            f"model.attention.mla.q_lora_rank={self.q_lora_rank} must be >= 0 (0 = full-rank queries)",
        )
        _require(
            self.qk_rope_head_dim % 2 == 0,
            f"model.attention.mla.qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs)",
        )


# model/mixers/attention_backend.py
ATTENTION_BACKEND_CHOICES = ("auto", "sdpa", "matmul", "flex", "triton")
KERNEL_CHOICES = ("torch", "triton")


@dataclass(kw_only=True)
class KernelsConfig:
    """Fused Triton training kernels (model/kernels/fused.py) in place of torch's separate ops.
    torch.compile already fuses these elementwise chains into Triton on GPUs, so they pay only
    where they beat it (bench/gpu_check.py measures; README); on CPU they run only under Triton's
    interpreter."""

    rms_norm: str = "torch"  # RMSNorm layers, and the add before the norm of post-norm/DeepNorm
    rope: str = "torch"  # the rotary embedding of queries and keys (both pairings)
    swiglu: str = "torch"  # silu(gate) * up of SwiGLU FFNs

    def __post_init__(self) -> None:
        for key in ("rms_norm", "rope", "swiglu"):
            value = getattr(self, key)
            _require(
                value in KERNEL_CHOICES,
                f"model.kernels.{key}={value!r}; choose one of: {', '.join(KERNEL_CHOICES)}",
            )


@dataclass(kw_only=True)
class AttentionConfig:
    """Self-attention: MHA/GQA/MQA through n_kv_heads (kind gqa), or MLA (kind mla)."""

    kind: str = "gqa"  # gqa (MHA when n_kv_heads = n_heads, MQA when 1) | mla
    n_heads: int = 8  # query heads
    n_kv_heads: int = 0  # key/value heads for gqa; 0 = n_heads (MHA)
    head_dim: int = 0  # per-head dims for gqa; 0 = d_model / n_heads
    qk_norm: bool = False  # RMSNorm over each query/key head's dims before RoPE (Qwen3)
    output_gate: bool = False  # elementwise sigmoid gate on the attention output, from the input
    # attend to at most this many most recent tokens (self included); 0 = all
    sliding_window: int = 0
    bias: bool = False  # biases on the q/k/v/o projections
    softmax_scale: float = 0.0  # logit scale; 0 = 1/sqrt(query-key head dim)
    # the attention kernel (model/mixers/attention_backend.py): auto (triton on CUDA under QK-clip; on a
    # CPU matmul for short bf16 sequences; else sdpa) | sdpa | matmul | flex | triton
    backend: str = "auto"
    mla: MLAConfig = field(default_factory=MLAConfig)  # used when kind = mla

    def __post_init__(self) -> None:
        _check_choice("model.attention.kind", self.kind, ATTENTIONS)
        _require(self.n_heads > 0, f"model.attention.n_heads={self.n_heads} must be > 0")
        _require(self.n_kv_heads >= 0, f"model.attention.n_kv_heads={self.n_kv_heads} must be >= 0")
        _require(self.head_dim >= 0, f"model.attention.head_dim={self.head_dim} must be >= 0")
        _require(
            self.sliding_window >= 0,
            f"model.attention.sliding_window={self.sliding_window} must be >= 0 (0 = off)",
        )
        _require(
            self.softmax_scale >= 0,
            f"model.attention.softmax_scale={self.softmax_scale} must be >= 0 (0 = 1/sqrt(head dim))",
        )
        kv = self.n_kv_heads or self.n_heads
        _require(
            self.n_heads % kv == 0,
            f"model.attention.n_heads={self.n_heads} is not divisible by model.attention.n_kv_heads={kv}",
        )
        _require(
            self.backend in ATTENTION_BACKEND_CHOICES,
            f"model.attention.backend={self.backend!r}; choose one of: "
            f"{', '.join(ATTENTION_BACKEND_CHOICES)}",
        )
        ATTENTIONS.get(self.kind).check_section(self)  # the kind's own rules on this section


DELTA_RULE_KERNELS = ("auto", "torch", "fla")


def _check_kernel(section: str, kernel: str) -> None:
    _require(
        kernel in DELTA_RULE_KERNELS,
        f"model.{section}.kernel={kernel!r}; choose one of: {', '.join(DELTA_RULE_KERNELS)}",
    )


@dataclass(kw_only=True)
class GDNConfig:
    """Gated DeltaNet layers (layer kind `gdn`, model/mixers/gdn.py): linear-time delta-rule mixing."""

    n_heads: int = 4  # query/key heads
    n_v_heads: int = (
        0  # value heads, n_v_heads / n_heads consecutive ones per key head; 0 = n_heads
    )
    head_dim: int = 64  # query/key dims per head
    v_head_dim: int = 0  # value dims per head; 0 = head_dim
    conv_kernel: int = 4  # short causal depthwise convolution over q, k, v
    allow_neg_eigval: bool = False  # beta in (0, 2) instead of (0, 1) (the OLMo-hybrid variant)
    chunk_size: int = 64  # tokens per chunk of the parallel form (results do not depend on it)
    kernel: str = "auto"  # auto (fla-core's Triton kernels on CUDA when installed) | torch | fla

    def __post_init__(self) -> None:
        for name in ("n_heads", "head_dim", "conv_kernel", "chunk_size"):
            _require(getattr(self, name) > 0, f"model.gdn.{name}={getattr(self, name)} must be > 0")
        _check_kernel("gdn", self.kernel)
        for name in ("n_v_heads", "v_head_dim"):
            _require(
                getattr(self, name) >= 0, f"model.gdn.{name}={getattr(self, name)} must be >= 0"
            )
        _require(
            (self.n_v_heads or self.n_heads) % self.n_heads == 0,
            f"model.gdn.n_v_heads={self.n_v_heads} is not a multiple of model.gdn.n_heads={self.n_heads}",
        )


@dataclass(kw_only=True)
class KDAConfig:
    """Kimi Delta Attention layers (layer kind `kda`, model/mixers/kda.py): a delta rule with a decay per
    key channel from a low-rank forget gate, and a low-rank sigmoid output gate."""

    n_heads: int = 4  # heads (queries, keys and values alike)
    head_dim: int = 64  # dims per head; also the rank of the forget and output gates
    conv_kernel: int = 4  # short causal depthwise convolution over q, k, v
    chunk_size: int = 64  # tokens per chunk of the parallel form (results do not depend on it)
    kernel: str = "auto"  # auto (fla-core's Triton kernels on CUDA when installed) | torch | fla

    def __post_init__(self) -> None:
        for name in ("n_heads", "head_dim", "conv_kernel", "chunk_size"):
            _require(getattr(self, name) > 0, f"model.kda.{name}={getattr(self, name)} must be > 0")
        _check_kernel("kda", self.kernel)


@dataclass(kw_only=True)
class AttnResConfig:
    """Attention Residuals (`model.residual=attnres`, model/residual/attnres.py)."""

    # layers per block of Block AttnRes (the sublayers see the completed block sums and the
    # running one); 0 = Full AttnRes (every earlier sublayer output is a source)
    block_layers: int = 0

    def __post_init__(self) -> None:
        _require(
            self.block_layers >= 0,
            f"model.attnres.block_layers={self.block_layers} must be >= 0 (0 = Full AttnRes)",
        )


ENGRAM_SHARDINGS = ("rows", "replicated")


@dataclass(kw_only=True)
class EngramConfig:
    """Engram conditional memory (model/engram/layer.py): hashed n-gram embedding tables read by the
    listed blocks and added to the residual stream before their token mixer."""

    layers: list[int] = field(default_factory=list)  # blocks with a memory (0-based); [] = off
    max_ngram: int = 3  # n-gram orders 2..max_ngram (the demo's max_ngram_size)
    heads: int = 8  # hash heads per order, each with its own prime-sized table
    dim: int = 512  # embedding width per order, split over its heads (dim / heads per head)
    # per order (2, 3, ...): the least rows of each head's table (distinct primes >= it); [] = 5 x
    # model.vocab_size for every order (the demo's engram_vocab_size)
    table_sizes: list[int] = field(default_factory=list)
    kernel: int = 4  # taps of the short causal conv on the gated value (dilation = max_ngram)
    seed: int = 0  # the hash multipliers' seed (numpy default_rng(seed + 10007 x layer))
    # what stands for the positions before a document's first token: -1 = an id of its own (one
    # past the canonical ids, colliding with no token); >= 0 = that token (the demo's pad_id)
    pad_id: int = -1
    # hash canonical ids (case, accents, spacing folded: data/token_compression.py), built from
    # the tokenizer at train start; false = the raw token ids
    compress_tokens: bool = True
    bias: bool = True  # biases on the key and value projections (the demo's nn.Linear default)
    # tables in host memory, the rows a step reads copied to the device (the paper's offload)
    offload: bool = False
    # sparse (row) gradients for the tables in one process, so a step's cost does not grow with
    # their size; false = dense gradients (the same update, for comparison)
    sparse_grad: bool = True
    # with several data-parallel ranks: rows = FSDP2 shards each table by rows (memory / ranks;
    # gathered every step, O(table) traffic) | replicated = every rank holds the whole table and
    # the step's sparse row gradients are averaged (traffic O(rows read), memory O(table))
    sharding: str = "rows"

    def __post_init__(self) -> None:
        _require(self.max_ngram >= 2, f"model.engram.max_ngram={self.max_ngram} must be >= 2")
        for name in ("heads", "dim", "kernel"):
            value = getattr(self, name)
            _require(value >= 1, f"model.engram.{name}={value} must be >= 1")
        _require(
            self.dim % self.heads == 0,
            f"model.engram.dim={self.dim} is not divisible by model.engram.heads={self.heads}",
        )
        orders = self.max_ngram - 1
        _require(
            not self.table_sizes or len(self.table_sizes) == orders,
            f"model.engram.table_sizes has {len(self.table_sizes)} entries; give one per n-gram "
            f"order 2..{self.max_ngram} ({orders}), or [] for 5 x the vocabulary",
        )
        _require(
            all(size >= 2 for size in self.table_sizes),
            f"model.engram.table_sizes={self.table_sizes}: every size must be >= 2",
        )
        _require(
            len(set(self.layers)) == len(self.layers),
            f"model.engram.layers={self.layers} lists a layer twice",
        )
        _require(self.pad_id >= -1, f"model.engram.pad_id={self.pad_id} must be >= -1")
        _require(
            self.sharding in ENGRAM_SHARDINGS,
            f"model.engram.sharding={self.sharding!r}; choose one of: {', '.join(ENGRAM_SHARDINGS)}",
        )
        _require(
            list(self.layers) == sorted(self.layers),
            f"model.engram.layers={self.layers} must be in increasing order (the tables' primes "
            "are dealt out layer after layer)",
        )

    @property
    def enabled(self) -> bool:
        return bool(self.layers)


@dataclass(kw_only=True)
class MTPConfig:
    """Multi-token prediction (DeepSeek-V3, model/mtp/heads.py): D sequential modules, module k
    predicting the token k + 1 ahead in training; the first drafts tokens for self-speculative
    decoding (model/mtp/speculative.py)."""

    depth: int = 0  # D modules after the main model; 0 = off
    # lambda: the objective is main + (lambda / D) x the sum of the D losses; 0 skips the modules
    weight: float = 0.3
    final_weight: float = 0.1  # lambda from switch_fraction of the run on (DeepSeek-V3: 0.3, 0.1)
    # the fraction of trainer.max_steps after which lambda is final_weight (DeepSeek-V3 switched
    # after 10T of 14.8T tokens); 1 = never
    switch_fraction: float = 0.7

    def __post_init__(self) -> None:
        _require(self.depth >= 0, f"model.mtp.depth={self.depth} must be >= 0 (0 = off)")
        for name in ("weight", "final_weight"):
            value = getattr(self, name)
            _require(value >= 0, f"model.mtp.{name}={value} must be >= 0")
        _require(
            0 <= self.switch_fraction <= 1,
            f"model.mtp.switch_fraction={self.switch_fraction} must be in [0, 1]",
        )

    def weight_at(self, step: int, max_steps: int) -> float:
        """lambda at optimizer step `step` (0-based) of a `max_steps` run."""
        return self.weight if step < self.switch_fraction * max_steps else self.final_weight


MHC_COLLAPSES = ("learned", "mean")


@dataclass(kw_only=True)
class MHCConfig:
    """mHC, manifold-constrained hyper-connections (`model.residual=mhc`, model/residual/mhc.py)."""

    streams: int = 4  # parallel residual streams n
    sinkhorn_iters: int = 20  # Sinkhorn-Knopp steps projecting each mixing matrix
    eps: float = 1e-6  # transformers' hc_eps: added to pre, comb and every Sinkhorn denominator
    collapse: str = "learned"  # learned (DeepSeek-V4's HyperHead) | mean
    recompute_maps: bool = True  # recompute the maps in backward instead of keeping Sinkhorn steps

    def __post_init__(self) -> None:
        for name in ("streams", "sinkhorn_iters"):
            _require(
                getattr(self, name) >= 1, f"model.mhc.{name}={getattr(self, name)} must be >= 1"
            )
        _require(self.eps >= 0, f"model.mhc.eps={self.eps} must be >= 0")
        _require(
            self.collapse in MHC_COLLAPSES,
            f"model.mhc.collapse={self.collapse!r}; choose one of: {', '.join(MHC_COLLAPSES)}",
        )


@dataclass(kw_only=True)
class FFNConfig:
    """The position-wise feed-forward network."""

    kind: str = "swiglu"  # swiglu | geglu | gelu | relu | relu2
    # hidden width; 0 = the rule: (8/3 d if gated else 4 d) * multiplier, rounded up
    hidden: int = 0
    multiplier: float = 1.0  # scales the rule's width (Llama's ffn_dim_multiplier)
    multiple_of: int = 256  # the rule rounds the width up to a multiple of this
    bias: bool = False  # biases on the FFN projections

    def __post_init__(self) -> None:
        _check_choice("model.ffn.kind", self.kind, FFNS)
        _require(self.hidden >= 0, f"model.ffn.hidden={self.hidden} must be >= 0 (0 = the rule)")
        _require(self.multiplier > 0, f"model.ffn.multiplier={self.multiplier} must be > 0")
        _require(self.multiple_of > 0, f"model.ffn.multiple_of={self.multiple_of} must be > 0")


@dataclass(kw_only=True)
class MoEConfig:
    """Mixture of experts in place of the dense FFN: DeepSeekMoE-style shared + fine-grained routed
    experts, top-k routing (optionally group-limited), auxiliary-loss and aux-loss-free balancing."""

    n_routed_experts: int = 0  # routed experts E per MoE layer; 0 = a dense model (no MoE anywhere)
    # always-active experts, fused into one gated FFN of n x shared_hidden
    n_shared_experts: int = 0
    top_k: int = 2  # routed experts per token
    expert_hidden: int = 0  # hidden width of each routed expert; 0 = the model's ffn_hidden
    shared_hidden: int = 0  # hidden width of each shared expert; 0 = expert_hidden
    # scale the shared experts' output by sigmoid(w . x), one learned w (C,) (Qwen2/3-Next MoE)
    shared_expert_gate: bool = False
    first_k_dense: int = 0  # the first k layers keep the dense FFN (width ffn_hidden)
    score_func: str = "softmax"  # softmax | sigmoid (DeepSeek-V3): expert scores from router logits
    norm_topk_prob: bool = True  # renormalize the k selected scores to sum to 1
    route_scale: float = 1.0  # multiplies the routing weights (DeepSeek-V3's routed_scaling_factor)
    n_groups: int = 1  # expert groups for group-limited routing (DeepSeek-V3: 8); 1 = off
    topk_groups: int = 1  # groups kept per token (by the sum of each group's top-2 scores)
    aux_loss_coef: float = 0.0  # Switch/GShard load-balancing loss over the batch's tokens
    # DeepSeek-V3 sequence-wise balance loss, averaged over sequences
    seq_aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0  # router z-loss: mean over tokens of logsumexp(logits)^2
    bias_update_rate: float = 0.0  # aux-loss-free balancing step gamma (selection bias); 0 = off
    # 0 = dropless; else ceil(cf x N x k / E) token slots per expert in training (eval: dropless)
    capacity_factor: float = 0.0

    def __post_init__(self) -> None:
        for name in ("n_routed_experts", "n_shared_experts", "expert_hidden", "shared_hidden"):
            value = getattr(self, name)
            _require(value >= 0, f"model.moe.{name}={value} must be >= 0")
        _require(
            self.first_k_dense >= 0, f"model.moe.first_k_dense={self.first_k_dense} must be >= 0"
        )
        _require(
            self.score_func in SCORE_FUNCS,
            f"model.moe.score_func={self.score_func!r}; choose one of: {', '.join(SCORE_FUNCS)}",
        )
        for name in (
            "aux_loss_coef",
            "seq_aux_loss_coef",
            "z_loss_coef",
            "bias_update_rate",
            "capacity_factor",
        ):
            value = getattr(self, name)
            _require(value >= 0, f"model.moe.{name}={value} must be >= 0 (0 = off)")
        _require(self.route_scale > 0, f"model.moe.route_scale={self.route_scale} must be > 0")
        if self.n_routed_experts == 0:
            return  # dense: the other fields are not used
        _require(
            not self.shared_expert_gate or self.n_shared_experts > 0,
            "model.moe.shared_expert_gate=true needs model.moe.n_shared_experts > 0 (it gates them)",
        )
        E = self.n_routed_experts
        _require(self.top_k >= 1, f"model.moe.top_k={self.top_k} must be >= 1")
        _require(
            self.top_k <= E,
            f"model.moe.top_k={self.top_k} must be <= model.moe.n_routed_experts={E}",
        )
        _require(self.n_groups >= 1, f"model.moe.n_groups={self.n_groups} must be >= 1")
        _require(
            E % self.n_groups == 0,
            f"model.moe.n_routed_experts={E} is not divisible by model.moe.n_groups={self.n_groups}",
        )
        _require(
            1 <= self.topk_groups <= self.n_groups,
            f"model.moe.topk_groups={self.topk_groups} must be in [1, model.moe.n_groups={self.n_groups}]",
        )
        reachable = self.topk_groups * (E // self.n_groups)
        _require(
            self.top_k <= reachable,
            f"model.moe.top_k={self.top_k} exceeds the {reachable} experts that "
            f"model.moe.topk_groups={self.topk_groups} groups of {E // self.n_groups} hold",
        )

    @property
    def enabled(self) -> bool:
        return self.n_routed_experts > 0


@dataclass(kw_only=True)
class InitConfig:
    """Weight initialization (truncated normal at +-3 std)."""

    std: float = 0.02  # std of embeddings, input projections and the output head
    # output projections: none | total: std/sqrt(2L) | layer: std/sqrt(2(l+1)); DeepNorm uses beta instead
    depth_scaling: str = "total"

    def __post_init__(self) -> None:
        _require(self.std > 0, f"model.init.std={self.std} must be > 0")
        _require(
            self.depth_scaling in DEPTH_SCALINGS,
            f"model.init.depth_scaling={self.depth_scaling!r}; choose one of: {', '.join(DEPTH_SCALINGS)}",
        )


@dataclass(kw_only=True)
class ModelConfig:
    """A decoder-only language model."""

    # 0 = take the tokenizer's (the trainer fills it in, padded to a multiple of 64)
    vocab_size: int = 0
    d_model: int = 256  # residual stream width
    n_layers: int = 4  # transformer blocks
    # longest sequence; sizes learned positions and is the rope scaling reference
    max_seq_len: int = 2048
    norm: str = "rms"  # rms | layer
    norm_eps: float = 1e-5  # epsilon of every norm
    # pre | post | deepnorm (post-norm with alpha-scaled residual, beta init) | attnres (Attention
    # Residuals: softmax over depth of the earlier sublayer outputs, model.attnres) | mhc (n
    # residual streams mixed by Sinkhorn-projected matrices, model.mhc)
    residual: str = "pre"
    position: str = "rope"  # rope | alibi | sinusoidal | learned | none
    rope: RopeConfig = field(default_factory=RopeConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    ffn: FFNConfig = field(default_factory=FFNConfig)
    tie_embeddings: bool = False  # the output head reuses the token embedding matrix
    init: InitConfig = field(default_factory=InitConfig)
    # tokens per chunk of the fused head + cross-entropy; 0 = unchunked
    loss_chunk_tokens: int = 4096
    moe: MoEConfig = field(default_factory=MoEConfig)  # n_routed_experts = 0: dense FFNs only
    gdn: GDNConfig = field(default_factory=GDNConfig)  # layers of kind gdn
    kda: KDAConfig = field(default_factory=KDAConfig)  # layers of kind kda
    attnres: AttnResConfig = field(default_factory=AttnResConfig)  # with residual=attnres
    mhc: MHCConfig = field(default_factory=MHCConfig)  # with residual=mhc
    engram: EngramConfig = field(default_factory=EngramConfig)  # n-gram memory on some layers
    mtp: MTPConfig = field(default_factory=MTPConfig)  # multi-token prediction modules
    kernels: KernelsConfig = field(default_factory=KernelsConfig)  # fused Triton training kernels
    # the token mixer (model.mixers.mixer MIXERS key) of each layer, one per layer; [] = layer_pattern
    layer_types: list[str] = field(default_factory=list)
    # a short list of mixer kinds repeated over the layers (e.g. [gdn, gdn, gdn, gqa]); [] = every
    # layer is attention.kind
    layer_pattern: list[str] = field(default_factory=list)
    # Qwen3-Next's rule: layers N-1, 2N-1, ... are attention.kind and the others linear_mixer
    # (full_attention_every=4: three linear layers, then one softmax layer); 0 = off
    full_attention_every: int = 0
    linear_mixer: str = "gdn"  # the other layers' kind under full_attention_every (gdn | kda)

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layers", "max_seq_len"):
            _require(getattr(self, name) > 0, f"model.{name}={getattr(self, name)} must be > 0")
        _require(self.vocab_size >= 0, f"model.vocab_size={self.vocab_size} must be >= 0")
        _require(self.norm_eps > 0, f"model.norm_eps={self.norm_eps} must be > 0")
        _require(
            self.loss_chunk_tokens >= 0,
            f"model.loss_chunk_tokens={self.loss_chunk_tokens} must be >= 0 (0 = unchunked)",
        )
        _check_choice("model.norm", self.norm, NORMS)
        _check_choice("model.residual", self.residual, RESIDUALS)
        _check_choice("model.position", self.position, POSITIONS)
        self._check_layout()
        self._check_moe()
        self._check_engram()

    def _check_layout(self) -> None:
        """The per-layer mixer kinds are known, and each kind's own rules hold (its `check`)."""
        for key in ("layer_types", "layer_pattern"):
            for kind in getattr(self, key):
                _check_choice(f"model.{key}", kind, MIXERS)
        _check_choice("model.linear_mixer", self.linear_mixer, MIXERS)
        given = [
            k for k in ("layer_types", "layer_pattern", "full_attention_every") if getattr(self, k)
        ]
        _require(
            len(given) <= 1,
            f"model.{' and model.'.join(given)} are {'both' if len(given) == 2 else 'all'} set; "
            "give one of them",
        )
        _require(
            self.full_attention_every >= 0,
            f"model.full_attention_every={self.full_attention_every} must be >= 0 (0 = off)",
        )
        _require(
            not self.layer_types or len(self.layer_types) == self.n_layers,
            f"model.layer_types has {len(self.layer_types)} entries for model.n_layers="
            f"{self.n_layers}; give one per layer (or a short model.layer_pattern to repeat)",
        )
        _require(
            len(self.layer_pattern) <= self.n_layers,
            f"model.layer_pattern has {len(self.layer_pattern)} entries, more than model.n_layers="
            f"{self.n_layers}",
        )
        for kind in dict.fromkeys(self.mixer_kinds()):
            MIXERS.get(kind).check(self)

    def _check_moe(self) -> None:
        moe = self.moe
        if not moe.enabled:
            return
        _require(
            moe.first_k_dense <= self.n_layers,
            f"model.moe.first_k_dense={moe.first_k_dense} must be <= model.n_layers={self.n_layers}",
        )
        _require(
            self.ffn.kind in GATED_FFNS,
            f"model.ffn.kind={self.ffn.kind!r}: MoE experts are gated FFNs; choose one of "
            f"{', '.join(GATED_FFNS)} (or set model.moe.n_routed_experts=0)",
        )
        _require(
            not self.ffn.bias,
            "model.ffn.bias=true is not supported with MoE (experts have no biases)",
        )

    def _check_engram(self) -> None:
        engram = self.engram
        bad = [i for i in engram.layers if not 0 <= i < self.n_layers]
        _require(
            not bad,
            f"model.engram.layers={engram.layers}: {bad} outside 0..{self.n_layers - 1} "
            f"(model.n_layers={self.n_layers})",
        )
        _require(
            self.vocab_size == 0 or engram.pad_id < self.vocab_size,
            f"model.engram.pad_id={engram.pad_id} is not a token id of model.vocab_size="
            f"{self.vocab_size}",
        )
        _require(
            not self.mtp.depth or self.residual in ("pre", "post", "deepnorm"),
            f"model.mtp.depth={self.mtp.depth} with model.residual={self.residual!r}: the MTP "
            "modules read the main model's (B, T, C) hidden state, which this stream only has "
            "after its collapse (Megatron-LM refuses mHC with MTP too); use pre, post or deepnorm",
        )
        if engram.enabled:
            streams = RESIDUALS.get(self.residual).parallel_streams(self)
            _require(
                streams is not None,
                f"model.engram needs parallel hidden states to add its memory to, and "
                f"model.residual={self.residual!r} carries sublayer outputs instead; use pre, post, "
                "deepnorm or mhc",
            )

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether block `layer_id` has an MoE FFN (after the first_k_dense dense layers)."""
        return self.moe.enabled and layer_id >= self.moe.first_k_dense

    def mixer_kinds(self) -> list[str]:
        """The token mixer of every layer: layer_types, else layer_pattern repeated, else
        full_attention_every's rule, else attention.kind everywhere."""
        if self.layer_types:
            return list(self.layer_types)
        pattern = self.layer_pattern or [self.attention.kind]
        if self.full_attention_every:
            pattern = [self.linear_mixer] * (self.full_attention_every - 1) + [self.attention.kind]
        return [pattern[i % len(pattern)] for i in range(self.n_layers)]

    def layout_summary(self) -> str:
        """The resolved stack in one line, e.g. 'layers 0-2: gqa + dense; layers 3-5: gqa + moe'."""
        runs: list[list] = []  # [first, last, (mixer, ffn)]
        for spec in self.layer_specs():
            kind = (spec.mixer, spec.ffn)
            if runs and runs[-1][2] == kind:
                runs[-1][1] = spec.index
            else:
                runs.append([spec.index, spec.index, kind])
        return "; ".join(
            f"{f'layer {a}' if a == b else f'layers {a}-{b}'}: {m} + {f}" for a, b, (m, f) in runs
        )

    def layer_specs(self) -> list[LayerSpec]:
        """The resolved stack: which mixer and which FFN each layer has (`model.inspect` prints it)."""
        return [
            LayerSpec(i, kind, "moe" if self.is_moe_layer(i) else "dense")
            for i, kind in enumerate(self.mixer_kinds())
        ]

    # ---- derived sizes -------------------------------------------------------------------------

    @property
    def head_dim(self) -> int:
        """Per-head dims of gqa attention."""
        return self.attention.head_dim or self.d_model // self.attention.n_heads

    @property
    def n_kv_heads(self) -> int:
        return self.attention.n_kv_heads or self.attention.n_heads

    @property
    def rotary_dim(self) -> int:
        """Dims per head that RoPE rotates in layers of the default kind (attention.kind)."""
        return MIXERS.get(self.attention.kind).rotary_dim_for(self)

    @property
    def ffn_hidden(self) -> int:
        """FFN width: explicit, or Llama's rule (8/3 d for gated FFNs, 4 d otherwise)."""
        if self.ffn.hidden:
            return self.ffn.hidden
        gated = self.ffn.kind in GATED_FFNS
        width = int(2 * 4 * self.d_model / 3) if gated else 4 * self.d_model
        width = int(self.ffn.multiplier * width)
        return self.ffn.multiple_of * math.ceil(width / self.ffn.multiple_of)

    @property
    def expert_hidden(self) -> int:
        """Hidden width of one routed expert."""
        return self.moe.expert_hidden or self.ffn_hidden

    @property
    def shared_hidden(self) -> int:
        """Hidden width of the fused shared experts (n_shared_experts x per-expert width)."""
        return self.moe.n_shared_experts * (self.moe.shared_hidden or self.expert_hidden)

    @property
    def rope_original_max_seq_len(self) -> int:
        return self.rope.original_max_seq_len or self.max_seq_len

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


C = TypeVar("C")


def config_from_dict(cls: type[C], data: dict[str, Any], path: str = "model") -> C:
    """Build a (nested) config dataclass from a plain dict; unknown keys fail with a suggestion."""
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must be a mapping, got {type(data).__name__}: {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"{path}.{key} is not a known key{hint} (valid: {', '.join(sorted(fields))})"
            )
        sub = _nested_dataclass(cls, key)
        if sub:
            kwargs[key] = config_from_dict(sub, value, f"{path}.{key}")
        else:
            kwargs[key] = _checked_scalar(f"{path}.{key}", fields[key].type, value)
    return cls(**kwargs)


_SCALARS = {"int": (int,), "float": (int, float), "bool": (bool,), "str": (str,)}


def _checked_scalar(key: str, type_name: Any, value: Any) -> Any:
    """Reject a value of the wrong type (YAML `1e-5` parses as a string, `true` is not an int)."""
    allowed = _SCALARS.get(str(type_name))
    if allowed is None:
        return value
    wrong_bool = isinstance(value, bool) and bool not in allowed
    if wrong_bool or not isinstance(value, allowed):
        raise ConfigError(
            f"{key}={value!r} must be of type {type_name}, got {type(value).__name__}"
        )
    return float(value) if type_name == "float" else value


def _nested_dataclass(cls: type, name: str) -> type | None:
    default = next(f for f in dataclasses.fields(cls) if f.name == name).default_factory
    if default is dataclasses.MISSING:
        return None
    return default if dataclasses.is_dataclass(default) else None
