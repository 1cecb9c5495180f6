"""Generation state: one state object per layer, preallocated, filled in place by prefill and decode.

Each token mixer makes its own (`TokenMixer.new_state`, model/mixers/mixer.py); `Cache` holds one per
layer and the number of tokens seen. Per-token caches grow with the context; `RecurrentState`
(Gated DeltaNet, KDA) is fixed-size: the conv's last K-1 inputs and the fp32 delta-rule state.

Shapes: B batch, Tmax cache capacity, K kv heads, D head dims, R MLA latent width, Dr rope dims.
Under tensor parallelism each rank's state holds its own heads (`TokenMixer.local_heads`).
  KVCache      k (B, K, Tmax, D), v (B, K, Tmax, Dv)        GQA stores only its K kv heads
  LatentCache  c (B, Tmax, R), k_rope (B, Tmax, Dr)          MLA stores the normalized latent and
                                                             the shared rope key, nothing per head
"""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor, nn


class LayerState(nn.Module):
    """One layer's generation state: buffers (not parameters), updated by the layer's forward.
    `fixed_size` states hold a summary of everything seen (a recurrence); the others one entry
    per position, so dropping the last tokens only needs `Cache.length` moved back."""

    fixed_size: ClassVar[bool] = False


class KVCache(LayerState):
    def __init__(self, k: Tensor, v: Tensor) -> None:
        super().__init__()
        self.register_buffer("k", k, persistent=False)
        self.register_buffer("v", v, persistent=False)

    def update(self, k: Tensor, v: Tensor, start: int) -> tuple[Tensor, Tensor]:
        """Write k, v (B, K, T, D) at [start, start+T) and return the filled prefix (B, K, start+T, D)."""
        end = start + k.shape[2]
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class LatentCache(LayerState):
    def __init__(self, c: Tensor, k_rope: Tensor) -> None:
        super().__init__()
        self.register_buffer("c", c, persistent=False)
        self.register_buffer("k_rope", k_rope, persistent=False)

    def update(self, c: Tensor, k_rope: Tensor, start: int) -> tuple[Tensor, Tensor]:
        """Write c (B, T, R) and k_rope (B, T, Dr) at [start, start+T); return the filled prefixes."""
        end = start + c.shape[1]
        self.c[:, start:end] = c
        self.k_rope[:, start:end] = k_rope
        return self.c[:, :end], self.k_rope[:, :end]


class RecurrentState(LayerState):
    """A linear-attention layer's fixed-size state: the last K-1 inputs of its short convolution
    (B, K-1, D) and the delta-rule state (B, H, Dk, Dv), kept in fp32 whatever the model dtype."""

    fixed_size = True

    def __init__(self, conv: Tensor, state: Tensor) -> None:
        super().__init__()
        self.register_buffer("conv", conv, persistent=False)
        self.register_buffer("state", state, persistent=False)


class Cache(nn.Module):
    """The whole model's generation state: one `LayerState` per layer plus how many tokens are stored."""

    def __init__(self, layers: list[LayerState], capacity: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.capacity = capacity
        self.length = 0

    def check_room(self, new_tokens: int) -> None:
        if self.length + new_tokens > self.capacity:
            raise ValueError(
                f"KV cache holds {self.capacity} tokens; {self.length} are used and {new_tokens} more "
                "were given. Allocate a larger cache (max_len) for this generation."
            )

    def snapshot(self) -> tuple[int, list[Tensor]]:
        """What `restore` needs to return here: the length and copies of the fixed-size states
        (per-position caches are overwritten past the length)."""
        return self.length, [b.clone() for b in self._fixed_buffers()]

    def restore(self, snapshot: tuple[int, list[Tensor]]) -> None:
        self.length, saved = snapshot
        for buffer, copy in zip(self._fixed_buffers(), saved, strict=True):
            buffer.copy_(copy)

    @property
    def has_fixed_state(self) -> bool:
        return any(True for _ in self._fixed_buffers())

    def _fixed_buffers(self) -> list[Tensor]:
        return [
            b
            for m in self.modules()
            if isinstance(m, LayerState) and m.fixed_size
            for b in m.buffers(recurse=False)
        ]

    def nbytes(self) -> int:
        return sum(buf.numel() * buf.element_size() for buf in self.buffers())
