"""A toy parametrised residual stream for the tests (registered as model.residual=toy_scaled).

The carried state is a pair (x, total): each sublayer adds scale * f(norm(x)) to x (a learned
per-sublayer, per-channel scale, 1 at init) and its raw output to the running total; the stream
collapses to x + mix * total (mix is learned, 0 at init). At initialization it is the pre-norm
model exactly; it carries a tuple between blocks and has parameters both in the blocks and at
the model level, which is what Attention Residuals and mHC need from the structure.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from model.config import ModelConfig
from model.registry import RESIDUALS
from model.residual.stream import Connection, ResidualStream, Sublayer
from tests.parallel.workers import train

NAME = "toy_scaled"


class ScaledConnection(Connection):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(width))

    def forward(
        self, state: tuple[Tensor, Tensor], sublayer: Sublayer, norm: nn.Module
    ) -> tuple[Tensor, Tensor]:
        x, total = state
        y = sublayer(norm(x))
        return x + self.scale * y, total + y

    def init_weights(self) -> None:
        nn.init.ones_(self.scale)

    def param_roles(self) -> dict[str, str]:
        return {"scale": "mixing"}


class ScaledStream(ResidualStream):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.mix = nn.Parameter(torch.empty(cfg.d_model))

    @classmethod
    def connection(cls, cfg: ModelConfig, layer_id: int, sublayer: str) -> Connection:
        return ScaledConnection(cfg.d_model)

    def expand(self, h: Tensor) -> tuple[Tensor, Tensor]:
        return h, torch.zeros_like(h)

    def collapse(self, state: tuple[Tensor, Tensor]) -> Tensor:
        x, total = state
        return x + self.mix * total

    def init_weights(self) -> None:
        nn.init.zeros_(self.mix)

    def param_roles(self) -> dict[str, str]:
        return {"mix": "mixing"}


if NAME not in RESIDUALS:
    RESIDUALS.register(NAME)(ScaledStream)


def train_toy(rank: int, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """workers.train in a process that has the toy stream registered (spawned ranks import this)."""
    return train(rank, *args, **kwargs)
