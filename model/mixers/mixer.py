"""The token-mixer protocol: what every layer kind of `model.layer_types` offers the system.

A token mixer is the sequence-mixing sublayer of a block (softmax attention of a kind; later
Gated DeltaNet, KDA, ...). It registers its class under a key in `MIXERS` (model/registry.py), owns
its config section and its validation, and implements `TokenMixer`. Nothing outside a mixer's own
file asks which kind it is: the model, accounting, `model.inspect`, HF export and the optimizer
(QK-clip, Muon's matrix blocks, parameter roles) call these methods.

Shapes: B batch, T new tokens, C d_model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import ModelConfig, RopeConfig
from model.init import InitStds
from model.mixers.masks import AttentionContext

if TYPE_CHECKING:
    from model.mixers.kv_cache import LayerState


@dataclass(frozen=True)
class LayerDims:
    """What a layer needs from the model beyond its own config section."""

    d_model: int
    norm_eps: float
    rope: RopeConfig | None  # None when model.position is not rope

    @classmethod
    def of(cls, cfg: ModelConfig) -> LayerDims:
        rope = cfg.rope if cfg.position == "rope" else None
        return cls(cfg.d_model, cfg.norm_eps, rope)


@dataclass(frozen=True)
class StateSize:
    """Elements of generation state one layer keeps: `per_token` for every token seen (a KV or
    latent cache) plus `fixed` whatever the length (a recurrent state); `mha_per_token` is what a
    multi-head attention cache of the same heads would keep per token (0 for non-attention)."""

    per_token: int
    fixed: int = 0
    mha_per_token: int = 0
    fixed_fp32: int = 0  # fixed elements kept in fp32 whatever the cache dtype (recurrent states)


def local_part(weight: Tensor) -> Tensor:
    """The part of `weight` this rank holds: tensor parallelism makes a split weight a
    distributed tensor (parallel/tensor_parallel.py), whose `to_local()` is this rank's rows;
    any other tensor is returned as it is. For code that reads a weight directly rather than
    calling its module (MLA's absorbed decode); model/ does not import torch.distributed."""
    to_local = getattr(weight, "to_local", None)
    return to_local() if to_local is not None else weight


def average_context(seq_len: int, window: int = 0) -> float:
    """Mean number of keys a query attends to under causal (and optionally sliding-window) masking."""
    if not window or window >= seq_len:
        return (seq_len + 1) / 2
    return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len


class TokenMixer(nn.Module):
    """Base class and written protocol of a token mixer (subclasses implement every method).

    `rotary_dim` is the number of dims per head that RoPE rotates (0: no RoPE): the model builds
    the rotations once per distinct value and the layer finds its own in `ctx.rope[rotary_dim]`.
    Optional hooks, implemented only where they mean something: QK-clip (`QKClipHooks`) and
    Muon's matrix blocks (`muon_matrix_blocks`, see optim/matrix_blocks.py)."""

    kind: ClassVar[str] = ""
    rotary_dim: int = 0
    # how many ranks tensor parallelism split this layer's heads over (parallel/ sets it on every
    # module whose plan it applied): generation states and decode paths use the heads this
    # rank holds (`local_heads`), the forwards read them off the projections' widths
    tensor_parallel_degree: int = 1
    tensor_parallel_rank: int = 0  # this rank's place in the split (its heads' first index)

    @classmethod
    def check(cls, cfg: ModelConfig) -> None:
        """Rules between this kind's section and the rest of the model config (ConfigError)."""

    @classmethod
    def check_section(cls, section: object) -> None:
        """Rules on this kind's config section alone, checked when the section is built."""

    @classmethod
    def rotary_dim_for(cls, cfg: ModelConfig) -> int:
        """The `rotary_dim` this kind's layers will have under `cfg` (0: no RoPE)."""
        return 0

    @classmethod
    def build(cls, cfg: ModelConfig, layer_id: int) -> TokenMixer:
        """This kind's layer for block `layer_id`, from its own section (and `LayerDims`)."""
        raise NotImplementedError

    def forward(self, x: Tensor, ctx: AttentionContext, state: LayerState | None = None) -> Tensor:
        """x (B, T, C) -> (B, T, C). `state`: this layer's generation state (prefill, decode)."""
        raise NotImplementedError

    def init_weights(self, stds: InitStds) -> None:
        raise NotImplementedError

    def mixing_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token outside the weight matmuls (attention scores and values, a
        recurrence's state updates), averaged over a sequence of `seq_len` tokens."""
        raise NotImplementedError

    def state_size(self) -> StateSize:
        raise NotImplementedError

    def new_state(
        self, batch: int, capacity: int, dtype: torch.dtype, device: torch.device
    ) -> LayerState:
        """Empty generation state for `batch` sequences of up to `capacity` tokens, sized for
        the heads this rank holds (all of them without tensor parallelism)."""
        raise NotImplementedError

    def local_heads(self, heads: int) -> int:
        """How many of `heads` heads this rank computes: heads / tp when tp divides them, else
        (tp a multiple of them: kv heads replicated over the ranks) the one its query heads use."""
        tp = self.tensor_parallel_degree
        return heads // tp if heads % tp == 0 else 1

    def describe(self) -> str:
        """One line for `model.inspect`, e.g. 'GQA 4q / 2kv x 64'."""
        raise NotImplementedError

    def attention_backend(self, device: torch.device, start: int) -> str | None:
        """The softmax-attention backend (model/mixers/attention_backend.py) a forward on `device` after
        `start` cached tokens uses, so that the model prepares its mask in that form; None for
        mixers that are not softmax attention."""
        return None


class QKClipHooks:
    """Optional mixer protocol for QK-clip (optim/qk_clip.py): softmax attention only.

    - `record_max_logits`: when True, training forwards keep `max_logits`, the (H,) running max
      of q.k x scale since the optimizer last read it, `reset_max_logits()` restarting it; under
      tensor parallelism a rank's entries outside its own heads stay -inf, so a MAX over the
      ranks gives every head's (`fold_max_logits`);
    - `qk_clip_row_scales(gamma)`: (parameter, per-row factor) pairs that scale head h's logits by
      gamma[h];
    - `qk_clip_blocker()`: why QK-clip cannot work on this layer (None: it can)."""

    record_max_logits = False
    max_logits: Tensor | None = None

    def reset_max_logits(self) -> None:
        """Start a new running max: (H,) fp32 -inf on the layer's device. Always a tensor once
        recording is on, so a compiled block sees the same kind of attribute in every forward
        (None in the first micro-batch and a tensor in the next compiled every block twice)."""
        device = next(self.parameters()).device  # a DTensor's: its local shard's device
        self.max_logits = torch.full(
            (self.n_heads,), float("-inf"), dtype=torch.float32, device=device
        )

    def fold_max_logits(self, new_max: Tensor) -> None:
        """Fold a forward's per-head max logits into `max_logits`. Under tensor parallelism
        `new_max` holds this rank's query heads only, [r h, (r + 1) h) for h = H / tp as the
        column-wise q projection splits them: it is placed there, -inf elsewhere."""
        local = new_max.shape[0]
        if local != self.n_heads:
            first = self.tensor_parallel_rank * local
            new_max = F.pad(new_max, (first, self.n_heads - first - local), value=float("-inf"))
        running = self.max_logits
        self.max_logits = new_max if running is None else torch.maximum(running, new_max)

    def qk_clip_row_scales(self, gamma: Tensor) -> list[tuple[Tensor, Tensor]]:
        raise NotImplementedError

    def qk_clip_blocker(self) -> str | None:
        return None
