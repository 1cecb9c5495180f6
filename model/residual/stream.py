"""The residual stream: the state carried between blocks (registry RESIDUALS, `model.residual`).

A stream kind is a model-level module with three duties:
  expand(h)      the embedding output (B, T, C) -> the stream state carried into block 0
  connection()   one module per sublayer (attention, FFN) that reads the sublayer's input from the
                 state, runs it, and writes its output back: state -> state
  collapse(s)    the state after the last block -> (B, T, C) for the final norm
The state may be any tensor or tuple of tensors (several parallel streams, a history of sublayer
outputs), so FSDP2's per-block wrapping, activation checkpointing, per-block compile and
generation all pass it through unchanged. Connections may have parameters of their own (they live
in the block, and are sharded with it); the stream's own parameters live in `Transformer.stream`.

The classic styles carry one (B, T, C) tensor and have no parameters:
  pre:      x + f(norm(x))
  post:     norm(x + f(x))
  deepnorm: norm(alpha * x + f(x)), with alpha = (2L)^(1/4) and the sublayer's value/FFN/output
            projections initialized with gain beta = (8L)^(-1/4) (DeepNet, decoder-only form, L layers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from model.config import ModelConfig
from model.registry import RESIDUALS
from model.training_hooks import Reduce, TrainingHook

Sublayer = Callable[[Tensor], Tensor]
State = Any  # a Tensor, or a tuple of Tensors, as the stream kind defines


def deepnorm_alpha(n_layers: int) -> float:
    """DeepNet residual scale for a decoder-only model with n_layers blocks: (2L)^(1/4)."""
    return (2 * n_layers) ** 0.25


def deepnorm_beta(n_layers: int) -> float:
    """DeepNet init gain for value, output and FFN projections: (8L)^(-1/4)."""
    return (8 * n_layers) ** -0.25


def layer_index(name: str) -> int:
    """The block of a module name: 'layers.3.attn_residual.depth' -> 3."""
    return int(name.split("layers.")[-1].split(".")[0])


def per_layer_means(
    prefix: str, keys: tuple[str, ...], layers: list[int], rows: list[list[float]]
) -> dict[str, float]:
    """Stream metrics per block: {prefix/layer{i}/key: the mean over block i's rows of the key's
    column} (a block's two sublayers each give a row)."""
    grouped: dict[int, list[list[float]]] = {}
    for layer, row in zip(layers, rows, strict=True):
        grouped.setdefault(layer, []).append(row)
    return {
        f"{prefix}/layer{layer}/{key}": sum(r[i] for r in group) / len(group)
        for layer, group in sorted(grouped.items())
        for i, key in enumerate(keys)
    }


class Fp32Parameters(nn.Module):
    """A module whose own parameters (and fp32 buffers) stay fp32 when the model is cast
    (`model.to(bf16)`, as trainer.precision=bf16_master does) and that FSDP2 shards as its own
    unit computing in fp32 (parallel/fsdp.py reads `keep_fp32`): zero-initialized pseudo-queries
    and stream maps whose small values bf16 would round (Megatron-LM and transformers keep them
    fp32 too), and their metric buffers."""

    keep_fp32: ClassVar[bool] = True

    def _apply(self, fn, recurse: bool = True):  # type: ignore[override]
        before = {name: p.data for name, p in self._parameters.items() if p is not None}
        buffers = {name: b for name, b in self._buffers.items() if b is not None}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._parameters[name]
            if old.dtype == torch.float32 and new is not None and new.dtype != torch.float32:
                new.data = old.to(new.device)  # the fp32 values, unrounded
        for name, old in buffers.items():  # fp32 metric buffers (mHC's stream statistics) too
            new = self._buffers[name]
            if old.dtype == torch.float32 and new is not None and new.dtype != torch.float32:
                self._buffers[name] = old.to(new.device)
        return self


class Connection(nn.Module):
    """One sublayer's residual connection: state -> state."""

    def forward(self, state: State, sublayer: Sublayer, norm: nn.Module) -> State:
        raise NotImplementedError

    def init_weights(self) -> None:
        """Parameter-free connections have nothing to initialize."""


class ResidualStream(nn.Module):
    """Base class of a stream kind (see the module docstring)."""

    final_norm: ClassVar[bool] = True  # whether the model needs a norm after the last block
    # trainer.compile compiles each block whole; a stream whose state differs in structure from
    # block to block (a growing number of sources) compiles the sublayers instead, so that one
    # graph serves every block (Dynamo's recompile limit is 8 per code object)
    compile_whole_blocks: ClassVar[bool] = True
    # how its summary metrics combine over pipeline stages (model.training_hooks)
    stage_combine: ClassVar[dict[str, str]] = {}

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_layers, self.width = cfg.n_layers, cfg.d_model

    @classmethod
    def parallel_streams(cls, cfg: ModelConfig) -> int | None:
        """How many hidden states of width C the state holds side by side: 1 for a (B, T, C)
        state, n for (B, T, n, C); None when it holds something else (sublayer outputs), so that
        a layer adding to the hidden state (Engram) cannot."""
        return 1

    @classmethod
    def init_gain(cls, cfg: ModelConfig) -> float | None:
        """DeepNorm's beta for value/FFN/output projections; None: the configured depth scaling."""
        return None

    @classmethod
    def connection(cls, cfg: ModelConfig, layer_id: int, sublayer: str) -> Connection:
        """The connection of block `layer_id`'s sublayer ("attn" or "ffn")."""
        raise NotImplementedError

    def expand(self, h: Tensor) -> State:
        return h

    def collapse(self, state: State) -> Tensor:
        return state

    # what crosses a pipeline stage (model/stages.py): the state as tensors and back, and their
    # shapes after `layers` blocks (B, T: the micro-batch's rows and the positions computed)
    def to_tensors(self, state: State) -> tuple[Tensor, ...]:
        return (state,)

    def from_tensors(self, tensors: tuple[Tensor, ...]) -> State:
        (state,) = tensors
        return state

    def boundary_shapes(self, layers: int, B: int, T: int) -> list[tuple[int, ...]]:
        return [(B, T, self.width)]

    def boundary_dtype(self, compute: torch.dtype) -> torch.dtype:
        """The dtype of the state between blocks when the sublayers compute in `compute`."""
        return compute

    def init_weights(self) -> None:
        """Parameter-free streams have nothing to initialize."""

    def flops_per_token(self) -> float:
        """Forward FLOPs per token of the stream's own mixing, beyond the sublayers' (none)."""
        return 0.0

    def stats(self, model: nn.Module) -> dict[str, float]:
        """Metrics of what the stream did in the last training forward (logged with the step)."""
        return {}


class StreamStatistics(TrainingHook):
    """The residual stream's metrics (`ResidualStream.stats`, e.g. Attention Residuals' depth
    weights) with each step's row, read after the backward: small summaries, no collective."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model  # the Transformer, whose `stream` this is
        self.stage_combine = type(model.stream).stage_combine

    def after_backward(self, reduce: Reduce) -> dict[str, float]:
        return self.model.stream.stats(self.model)


class _PreNorm(Connection):
    def forward(self, x: Tensor, sublayer: Sublayer, norm: nn.Module) -> Tensor:
        return x + sublayer(norm(x))


class _PostNorm(Connection):
    def __init__(self, alpha: float = 1.0) -> None:
        super().__init__()
        self.alpha = alpha

    def forward(self, x: Tensor, sublayer: Sublayer, norm: nn.Module) -> Tensor:
        scaled = x if self.alpha == 1.0 else self.alpha * x  # first: autograd's summation order
        y = sublayer(x)
        if hasattr(norm, "add_and_normalize"):  # RMSNorm: the add fused into the norm's kernel
            return norm.add_and_normalize(scaled, y)
        return norm(scaled + y)


@RESIDUALS.register("pre")
class PreNorm(ResidualStream):
    @classmethod
    def connection(cls, cfg: ModelConfig, layer_id: int, sublayer: str) -> Connection:
        return _PreNorm()


@RESIDUALS.register("post")
class PostNorm(ResidualStream):
    final_norm = False  # the last block already ends with a norm

    @classmethod
    def connection(cls, cfg: ModelConfig, layer_id: int, sublayer: str) -> Connection:
        return _PostNorm()


@RESIDUALS.register("deepnorm")
class DeepNorm(ResidualStream):
    final_norm = False

    @classmethod
    def init_gain(cls, cfg: ModelConfig) -> float:
        return deepnorm_beta(cfg.n_layers)

    @classmethod
    def connection(cls, cfg: ModelConfig, layer_id: int, sublayer: str) -> Connection:
        return _PostNorm(deepnorm_alpha(cfg.n_layers))
