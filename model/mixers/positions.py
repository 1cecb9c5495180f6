"""Position encodings (registry POSITIONS), one module per kind, all with the same three hooks:

  additive(positions)        (B, T, C) added to the token embeddings, or None   (sinusoidal, learned)
  rotary(positions, length, R)  (B, T, R/2) complex rotations of R dims, or None  (rope)
  alibi_slopes()             (H,) per-head slopes of the linear distance bias, or None   (alibi)

positions (B, T) are each token's index (within its document when documents are packed); `length`
is the total sequence length including cached tokens (dynamic NTK rescales beyond the original).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from model import roles
from model.config import ModelConfig
from model.init import trunc_normal_
from model.mixers.rope import rope_frequencies, rope_rotations
from model.registry import POSITIONS


class PositionEncoding(nn.Module):
    def additive(self, positions: Tensor) -> Tensor | None:
        return None

    def rotary(self, positions: Tensor, length: int, rotary_dim: int) -> Tensor | None:
        return None

    def alibi_slopes(self, device: torch.device | None = None) -> Tensor | None:
        return None

    def init_weights(self, std: float) -> None:
        pass


@POSITIONS.register("none")
class NoPosition(PositionEncoding):
    """No explicit positions (NoPE): causal attention alone carries order."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()


@POSITIONS.register("rope")
class Rotary(PositionEncoding):
    """RoPE angles, for each rotary width R the layers ask for (layers of different kinds may
    rotate different numbers of dims). The fp32 frequency tables are kept per (device, R) outside
    the module's buffers, so meta-device builds need no re-init and `model.to(torch.bfloat16)`
    cannot round them."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg.rope
        self.original = cfg.rope_original_max_seq_len
        self._tables: dict[tuple[torch.device, int], tuple[Tensor, float]] = {}

    def rotary(self, positions: Tensor, length: int, rotary_dim: int) -> Tensor:
        inv_freq, factor = self.frequencies(positions.device, length, rotary_dim)
        return rope_rotations(positions, inv_freq, factor)

    def frequencies(
        self, device: torch.device, length: int, rotary_dim: int
    ) -> tuple[Tensor, float]:
        """(inv_freq (R/2,) fp32 on `device`, cos/sin factor); dynamic NTK recomputes the table
        for lengths beyond the original."""
        if self.cfg.scaling == "dynamic_ntk" and length > self.original:
            inv_freq, factor = rope_frequencies(self.cfg, rotary_dim, self.original, length)
            return inv_freq.to(device), factor
        key = (device, rotary_dim)
        if key not in self._tables:
            inv_freq, factor = rope_frequencies(self.cfg, rotary_dim, self.original, self.original)
            self._tables[key] = (inv_freq.to(device), factor)
        return self._tables[key]


def alibi_slopes(n_heads: int) -> Tensor:
    """ALiBi's geometric slopes 2^(-8i/n); for non-powers of two, Press et al.'s interleaved extension."""

    def powers_of_two(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = powers_of_two(closest)
    if closest < n_heads:
        slopes += powers_of_two(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


@POSITIONS.register("alibi")
class ALiBi(PositionEncoding):
    """Linear bias -slope_h * (i - j) on the attention logits (query i, key j)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.attention.n_heads
        self._slopes: dict[torch.device, Tensor] = {}  # per device: no host-to-device copy per step

    def alibi_slopes(self, device: torch.device | None = None) -> Tensor:
        device = torch.device(device or "cpu")
        if device not in self._slopes:
            self._slopes[device] = alibi_slopes(self.n_heads).to(device)
        return self._slopes[device]


@POSITIONS.register("sinusoidal")
class Sinusoidal(PositionEncoding):
    """Vaswani et al.: dims (2i, 2i+1) = sin, cos of pos / 10000^(2i/C)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.d_model = cfg.d_model

    def additive(self, positions: Tensor) -> Tensor:
        exponents = torch.arange(0, self.d_model, 2, device=positions.device) / self.d_model
        angles = positions.float()[..., None] / 10000**exponents  # (B, T, C/2)
        return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(-2)[..., : self.d_model]


@POSITIONS.register("learned")
class Learned(PositionEncoding):
    """A trained table of max_seq_len position vectors (GPT-2)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.max_seq_len, cfg.d_model))

    def param_roles(self) -> dict[str, str]:
        return {"weight": roles.EMBEDDING}

    def additive(self, positions: Tensor) -> Tensor:
        return self.weight[positions]

    def init_weights(self, std: float) -> None:
        trunc_normal_(self.weight, std)


def build_positions(cfg: ModelConfig) -> PositionEncoding:
    return POSITIONS.get(cfg.position)(cfg)
