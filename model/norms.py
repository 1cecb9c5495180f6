"""Normalization layers (registry NORMS) and residual styles (registry RESIDUALS).

Shapes: (..., C) with C the normalized width. Residual styles wrap one sublayer f:
  pre:      x + f(norm(x))
  post:     norm(x + f(x))
  deepnorm: norm(alpha * x + f(x)), with alpha = (2L)^(1/4) and the sublayer's value/FFN/output
            projections initialized with gain beta = (8L)^(-1/4) (DeepNet, decoder-only form, L layers).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.registry import NORMS, RESIDUALS


@NORMS.register("rms")
class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: Tensor) -> Tensor:
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (y * self.weight.float()).to(x.dtype)

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


@NORMS.register("layer")
class LayerNorm(nn.Module):
    """Standard LayerNorm (mean-centred, weight and bias), computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.bias = nn.Parameter(torch.empty(dim))

    def forward(self, x: Tensor) -> Tensor:
        y = F.layer_norm(
            x.float(), (x.shape[-1],), self.weight.float(), self.bias.float(), self.eps
        )
        return y.to(x.dtype)

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)


def build_norm(kind: str, dim: int, eps: float) -> nn.Module:
    return NORMS.get(kind)(dim, eps)


# ---- residual styles --------------------------------------------------------------------------


def deepnorm_alpha(n_layers: int) -> float:
    """DeepNet residual scale for a decoder-only model with n_layers blocks: (2L)^(1/4)."""
    return (2 * n_layers) ** 0.25


def deepnorm_beta(n_layers: int) -> float:
    """DeepNet init gain for value, output and FFN projections: (8L)^(-1/4)."""
    return (8 * n_layers) ** -0.25


Sublayer = Callable[[Tensor], Tensor]


class Residual:
    """How a block combines its input with one sublayer.

    `init_gain` (DeepNorm's beta, None otherwise) replaces the configured depth scaling: value, FFN
    and output projections are initialized with std x gain."""

    final_norm = True  # whether the model needs a norm after the last block

    def __init__(self, n_layers: int) -> None:
        self.n_layers = n_layers

    @property
    def init_gain(self) -> float | None:
        return None

    def __call__(self, x: Tensor, sublayer: Sublayer, norm: nn.Module) -> Tensor:
        raise NotImplementedError


@RESIDUALS.register("pre")
class PreNorm(Residual):
    def __call__(self, x: Tensor, sublayer: Sublayer, norm: nn.Module) -> Tensor:
        return x + sublayer(norm(x))


@RESIDUALS.register("post")
class PostNorm(Residual):
    final_norm = False  # the last block already ends with a norm

    def __call__(self, x: Tensor, sublayer: Sublayer, norm: nn.Module) -> Tensor:
        return norm(x + sublayer(x))


@RESIDUALS.register("deepnorm")
class DeepNorm(Residual):
    final_norm = False

    @property
    def alpha(self) -> float:
        return deepnorm_alpha(self.n_layers)

    @property
    def init_gain(self) -> float:
        return deepnorm_beta(self.n_layers)

    def __call__(self, x: Tensor, sublayer: Sublayer, norm: nn.Module) -> Tensor:
        return norm(self.alpha * x + sublayer(x))
