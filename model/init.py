"""Weight initialization: truncated normal (+-3 std), with depth-scaled output projections."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor, nn

from model.config import InitConfig


@dataclass(frozen=True)
class InitStds:
    """Per-role std of one block's linear layers."""

    inner: float  # query/key projections, MLA down-projections, the output gate
    value: float  # value projection and FFN input projections (DeepNorm multiplies these by beta)
    out: float  # attention output and FFN down projections (depth-scaled; DeepNorm: times beta)


def block_init_stds(
    init: InitConfig, n_layers: int, layer_id: int, gain: float | None = None
) -> InitStds:
    """Stds for block `layer_id`. `gain` (DeepNorm's beta) is itself a depth scaling: with it,
    value/FFN/output projections get std x gain and init.depth_scaling is not applied on top."""
    if gain is not None:
        return InitStds(inner=init.std, value=init.std * gain, out=init.std * gain)
    if init.depth_scaling == "total":
        out = init.std / math.sqrt(2 * n_layers)
    elif init.depth_scaling == "layer":
        out = init.std / math.sqrt(2 * (layer_id + 1))
    else:
        out = init.std
    return InitStds(inner=init.std, value=init.std, out=out)


def trunc_normal_(weight: Tensor, std: float) -> None:
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


def init_linear(linear: nn.Linear, std: float) -> None:
    trunc_normal_(linear.weight, std)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)
