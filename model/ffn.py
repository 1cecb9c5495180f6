"""Position-wise feed-forward networks (registry FFNS).

Shapes: x (..., C) -> (..., C) through a hidden width F.
Gated (GLU) variants: down(act(gate(x)) * up(x)); plain ones: down(act(up(x))).
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor, nn

from model.config import KernelsConfig
from model.init import InitStds, init_linear
from model.kernels.fused import swiglu
from model.registry import FFNS


def _relu2(x: Tensor) -> Tensor:
    return F.relu(x).square()


class GatedFFN(nn.Module):
    activation: Callable[[Tensor], Tensor]

    def __init__(self, d_model: int, hidden: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, hidden, bias=bias)
        self.up_proj = nn.Linear(d_model, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(type(self).activation(self.gate_proj(x)) * self.up_proj(x))

    def tensor_parallel_plan(self, tp: int) -> dict[str, str]:
        """The hidden units split over `tp` ranks: gate and up column-wise, down row-wise."""
        return {
            "gate_proj": "colwise",
            "up_proj": "colwise",
            "down_proj": "rowwise",
        }

    def init_weights(self, stds: InitStds) -> None:
        init_linear(self.gate_proj, stds.value)
        init_linear(self.up_proj, stds.value)
        init_linear(self.down_proj, stds.out)


class PlainFFN(nn.Module):
    activation: Callable[[Tensor], Tensor]

    def __init__(self, d_model: int, hidden: int, bias: bool = False) -> None:
        super().__init__()
        self.up_proj = nn.Linear(d_model, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(type(self).activation(self.up_proj(x)))

    def tensor_parallel_plan(self, tp: int) -> dict[str, str]:
        """The hidden units split over `tp` ranks: up column-wise, down row-wise."""
        return {"up_proj": "colwise", "down_proj": "rowwise"}

    def init_weights(self, stds: InitStds) -> None:
        init_linear(self.up_proj, stds.value)
        init_linear(self.down_proj, stds.out)


@FFNS.register("swiglu")
class SwiGLU(GatedFFN):
    activation = staticmethod(F.silu)
    kernel = "torch"  # torch | triton (model.kernels.swiglu: model/kernels/fused.py)

    def use_kernels(self, kernels: KernelsConfig) -> None:
        self.kernel = kernels.swiglu

    def forward(self, x: Tensor) -> Tensor:
        if self.kernel == "triton":
            return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))
        return super().forward(x)


@FFNS.register("geglu")
class GeGLU(GatedFFN):
    activation = staticmethod(F.gelu)


@FFNS.register("gelu")
class GeluFFN(PlainFFN):
    activation = staticmethod(F.gelu)


@FFNS.register("relu")
class ReluFFN(PlainFFN):
    activation = staticmethod(F.relu)


@FFNS.register("relu2")
class Relu2FFN(PlainFFN):
    """Squared ReLU (Primer)."""

    activation = staticmethod(_relu2)
