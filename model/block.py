"""One transformer block: a token-mixer sublayer and an FFN sublayer, each joined to the residual
stream by its own connection (model/residual/stream.py).

Shapes: the stream state (for the classic residual styles x (B, T, C)) -> the same. The mixer is
the layer's kind from the resolved layout (`ModelConfig.layer_specs`, registry MIXERS); the FFN
is the dense one (registry FFNS), or an MoE layer on the layers the layout marks "moe". Blocks
listed in `model.engram.layers` first add their Engram memory to the stream (model/engram/layer.py).
"""

from __future__ import annotations

import torch
from torch import nn

from model.config import LayerSpec, ModelConfig
from model.engram.layer import Engram, WithMemory
from model.init import block_init_stds
from model.mixers.kv_cache import LayerState
from model.mixers.masks import AttentionContext
from model.moe.layer import MoE
from model.norms import build_norm
from model.registry import FFNS, MIXERS, RESIDUALS
from model.residual.stream import State


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, spec: LayerSpec | None = None) -> None:
        """`spec`: the layer's kind when it is not one of the stack's (an MTP module's block)."""
        super().__init__()
        self.layer_id = layer_id
        self.spec: LayerSpec = spec or cfg.layer_specs()[layer_id]
        stream = RESIDUALS.get(cfg.residual)
        self.engram = (
            Engram(cfg, layer_id, stream.parallel_streams(cfg))
            if layer_id in cfg.engram.layers
            else None
        )
        self.attn_norm = build_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.attn = MIXERS.get(self.spec.mixer).build(cfg, layer_id)
        self.attn_residual = stream.connection(cfg, layer_id, "attn")
        self.ffn_norm = build_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.ffn = build_ffn(cfg, self.spec)
        self.ffn_residual = stream.connection(cfg, layer_id, "ffn")
        self.init_gain = stream.init_gain(cfg)

    def forward(
        self, state: State, ctx: AttentionContext, cache: LayerState | None = None
    ) -> State:
        """`state`: the residual stream's; `cache`: this layer's generation state."""
        if self.engram is not None:
            memory = cache.memory if isinstance(cache, WithMemory) else None
            cache = cache.mixer if isinstance(cache, WithMemory) else cache
            state = self.engram(state, ctx, memory)
        state = self.attn_residual(state, lambda h: self.attn(h, ctx, cache), self.attn_norm)
        return self.ffn_residual(state, self.ffn, self.ffn_norm)

    def whole_sequence_sublayers(self) -> list[str]:
        """The children that need every position of the sequence (token mixers, Engram's
        n-grams and conv) or the same tokens on every tensor-parallel rank (the FFN or MoE
        layer): under sequence parallelism (parallel/sequence_parallel.py) their input is
        gathered and their output reduce-scattered (or cut) back to the rank's positions. Each takes the stream's
        (B, T, ...) tensor first; everything else in the block acts per position."""
        return (["engram"] if self.engram is not None else []) + ["attn", "ffn"]

    def init_weights(self, cfg: ModelConfig) -> None:
        stds = block_init_stds(cfg.init, cfg.n_layers, self.layer_id, self.init_gain)
        self.attn.init_weights(stds)
        self.ffn.init_weights(stds)
        self.attn_norm.init_weights()
        self.ffn_norm.init_weights()
        self.attn_residual.init_weights()
        self.ffn_residual.init_weights()
        if self.engram is not None:
            self.engram.init_weights(stds, cfg.init.std)

    def new_state(
        self, batch: int, capacity: int, dtype: torch.dtype, device: torch.device
    ) -> LayerState:
        """Empty generation state: the mixer's, with the memory's when the block has one."""
        mixer = self.attn.new_state(batch, capacity, dtype, device)
        if self.engram is None:
            return mixer
        return WithMemory(mixer, self.engram.new_state(batch, dtype, device))


def build_ffn(cfg: ModelConfig, spec: LayerSpec) -> nn.Module:
    """The layer's FFN: MoE where the layout says so (after moe.first_k_dense), else dense."""
    if spec.ffn == "moe":
        return MoE(cfg, spec.index)
    return FFNS.get(cfg.ffn.kind)(cfg.d_model, cfg.ffn_hidden, cfg.ffn.bias)
