"""One transformer block: attention and FFN sublayers joined by the configured residual style.

Shapes: x (B, T, C) -> (B, T, C). The FFN is the dense one (registry FFNS), or an MoE layer from
block model.moe.first_k_dense on when model.moe.n_routed_experts > 0.
"""

from __future__ import annotations

from torch import Tensor, nn

from model.config import ModelConfig
from model.init import block_init_stds
from model.masks import AttentionContext
from model.moe.layer import MoE
from model.norms import build_norm
from model.registry import ATTENTIONS, FFNS, RESIDUALS


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attn_norm = build_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.attn = ATTENTIONS.get(cfg.attention.kind)(cfg)
        self.ffn_norm = build_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.ffn = build_ffn(cfg, layer_id)
        self.residual = RESIDUALS.get(cfg.residual)(cfg.n_layers)  # a plain strategy, no parameters

    def forward(self, x: Tensor, ctx: AttentionContext, cache: nn.Module | None = None) -> Tensor:
        x = self.residual(x, lambda h: self.attn(h, ctx, cache), self.attn_norm)
        return self.residual(x, self.ffn, self.ffn_norm)

    def init_weights(self, cfg: ModelConfig) -> None:
        stds = block_init_stds(cfg.init, cfg.n_layers, self.layer_id, self.residual.init_gain)
        self.attn.init_weights(stds)
        self.ffn.init_weights(stds)
        self.attn_norm.init_weights()
        self.ffn_norm.init_weights()


def build_ffn(cfg: ModelConfig, layer_id: int) -> nn.Module:
    """Block `layer_id`'s FFN: MoE after the first_k_dense layers of an MoE model, else dense."""
    if cfg.is_moe_layer(layer_id):
        return MoE(cfg, layer_id)
    return FFNS.get(cfg.ffn.kind)(cfg.d_model, cfg.ffn_hidden, cfg.ffn.bias)
