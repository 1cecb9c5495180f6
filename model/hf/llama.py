"""The Llama family (`LlamaForCausalLM`) and Qwen3 (`Qwen3ForCausalLM`: Llama plus per-head
QK-norm, no MLP bias).

RoPE pairing: HF checkpoints use the half-split pairing. A model trained with interleaved pairs is
exported by permuting the rows of each head of W_q and W_k (and the QK-norm weights) with
`interleaved_to_half`, which leaves every attention score unchanged; importing with
`rope_pairing="interleaved"` applies the inverse, so export -> import round-trips bitwise in both
layouts.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

from model.config import AttentionConfig, ConfigError, FFNConfig, InitConfig, ModelConfig
from model.hf.family import HF_FAMILIES, HFFamily
from model.hf.rope import hf_max_positions, rope_from_hf, rope_scaling
from model.mixers.rope import half_to_interleaved, interleaved_to_half

PAIRED = re.compile(r"attn\.(q|k)_(proj\.(weight|bias)|norm\.weight)$")  # rows laid out per head


LLAMA_MIXERS = (
    "gqa",
)  # the token mixers (model.mixers.mixer MIXERS keys) a Llama/Qwen3 layer can be


def _common_unsupported(cfg: ModelConfig) -> str | None:
    """The first option Llama/Qwen3 cannot express, as `key=value (why)`, or None."""
    att, rope = cfg.attention, cfg.rope
    if att.kind not in LLAMA_MIXERS:
        return f"attention.kind={att.kind!r} (MLA exports as DeepSeek-V3, MLA NoPE as Kimi Linear)"
    other = next((kind for kind in cfg.mixer_kinds() if kind not in LLAMA_MIXERS), None)
    if other is not None:
        return f"layer_types/layer_pattern with {other!r} layers (Llama/Qwen3 layers are all GQA)"
    rotary = cfg.rotary_dim
    checks = [
        (cfg.position != "rope", lambda: f"position={cfg.position!r} (Llama/Qwen3 use RoPE)"),
        (cfg.residual != "pre", lambda: f"residual={cfg.residual!r} (Llama/Qwen3 are pre-norm)"),
        (cfg.norm != "rms", lambda: f"norm={cfg.norm!r} (Llama/Qwen3 use RMSNorm)"),
        (cfg.ffn.kind != "swiglu", lambda: f"ffn.kind={cfg.ffn.kind!r} (Llama/Qwen3 use SwiGLU)"),
        (att.output_gate, lambda: "attention.output_gate=true"),
        (att.sliding_window > 0, lambda: f"attention.sliding_window={att.sliding_window}"),
        (
            att.softmax_scale > 0,
            lambda: f"attention.softmax_scale={att.softmax_scale} (HF uses head_dim^-0.5)",
        ),
        (rope.fraction != 1.0, lambda: f"rope.fraction={rope.fraction} (partial rotary)"),
        (
            rope.scaling == "ntk",
            lambda: (
                "rope.scaling='ntk' (static NTK is plain RoPE with rope.theta="
                f"{rope.theta * rope.factor ** (rotary / (rotary - 2)):g}; set that and no scaling)"
            ),
        ),
        (
            rope.scaling == "yarn" and rope.mscale_all_dim > 0,
            lambda: (
                f"rope.mscale_all_dim={rope.mscale_all_dim} (Llama/Qwen3 YaRN scales only cos/sin)"
            ),
        ),
    ]
    return next((describe() for bad, describe in checks if bad), None)


def gqa_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """config.json fields of GQA attention layers (Llama, Qwen3, Qwen3-Next's full layers)."""
    return {
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": hf_max_positions(cfg),
    }


def _all_attention(cfg: ModelConfig) -> bool:
    """A dense model whose every layer is softmax attention (hybrid stacks belong to the hybrid
    families, MoE ones to Qwen3-MoE / Mixtral)."""
    return not cfg.moe.enabled and all(kind in LLAMA_MIXERS for kind in cfg.mixer_kinds())


class LlamaLike(HFFamily):
    """What Llama and Qwen3 share: names, config fields, the RoPE pairing fix."""

    to_hf_names = (
        (r"embed\.weight", "model.embed_tokens.weight"),
        (r"norm\.weight", "model.norm.weight"),
        (r"head\.weight", "lm_head.weight"),
        (r"layers\.(\d+)\.attn_norm\.weight", "model.layers.{}.input_layernorm.weight"),
        (r"layers\.(\d+)\.ffn_norm\.weight", "model.layers.{}.post_attention_layernorm.weight"),
        (
            r"layers\.(\d+)\.attn\.((?:q|k|v|o)_proj\.(?:weight|bias)|(?:q|k)_norm\.weight)",
            "model.layers.{}.self_attn.{}",
        ),
        (
            r"layers\.(\d+)\.ffn\.((?:gate|up|down)_proj\.(?:weight|bias))",
            "model.layers.{}.mlp.{}",
        ),
    )
    from_hf_names = (
        (r"model\.embed_tokens\.weight", "embed.weight"),
        (r"model\.norm\.weight", "norm.weight"),
        (r"lm_head\.weight", "head.weight"),
        (r"model\.layers\.(\d+)\.input_layernorm\.weight", "layers.{}.attn_norm.weight"),
        (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "layers.{}.ffn_norm.weight"),
        (r"model\.layers\.(\d+)\.self_attn\.(.+)", "layers.{}.attn.{}"),
        (r"model\.layers\.(\d+)\.mlp\.(.+)", "layers.{}.ffn.{}"),
    )

    def _family_unsupported(self, cfg: ModelConfig) -> str | None:
        raise NotImplementedError

    def unsupported(self, cfg: ModelConfig) -> str | None:
        if cfg.moe.enabled:
            return (
                f"model.moe.n_routed_experts={cfg.moe.n_routed_experts} with "
                f"attention.kind={cfg.attention.kind!r}: MoE models export as Qwen3-MoE / Mixtral "
                "(GQA layers), DeepSeek-V3 (MLA) or the hybrid families"
            )
        option = _common_unsupported(cfg) or self._family_unsupported(cfg)
        return None if option is None else f"model.{option} has no Llama/Qwen3 equivalent"

    def to_hf_config(self, cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
        return (
            self.base_hf_config(cfg, dtype)
            | gqa_hf_config(cfg)
            | {
                "rope_theta": cfg.rope.theta,
                "rope_scaling": rope_scaling(cfg.rope),
            }
        )

    def from_hf_config(self, hf: dict[str, Any], rope_pairing: str) -> ModelConfig:
        if hf.get("partial_rotary_factor", 1.0) != 1.0:
            raise ConfigError(
                f"partial_rotary_factor={hf['partial_rotary_factor']} is not supported for import"
            )
        if hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or []):
            raise ConfigError(
                "sliding-window layers (use_sliding_window / layer_types) are not supported for import"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(
                f"hidden_act={hf['hidden_act']!r} is not supported (SwiGLU needs silu)"
            )
        heads = hf["num_attention_heads"]
        rope, max_seq_len = rope_from_hf(hf, rope_pairing)
        return ModelConfig(
            vocab_size=hf["vocab_size"],
            d_model=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            max_seq_len=max_seq_len,
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=rope,
            attention=AttentionConfig(
                n_heads=heads,
                n_kv_heads=hf.get("num_key_value_heads") or heads,
                head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
                qk_norm=self.qk_norm,
                bias=bool(hf.get("attention_bias", False)),
            ),
            ffn=FFNConfig(
                kind="swiglu",
                hidden=hf["intermediate_size"],
                bias=bool(hf.get("mlp_bias", False)),
            ),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            init=InitConfig(std=float(hf.get("initializer_range", 0.02))),
        )

    qk_norm = False

    def to_hf_tensor(self, name: str, tensor: Tensor, cfg: ModelConfig) -> Tensor:
        return self._pairing(name, tensor, cfg, interleaved_to_half)

    def from_hf_tensor(self, name: str, tensor: Tensor, cfg: ModelConfig) -> Tensor:
        return self._pairing(name, tensor, cfg, half_to_interleaved)

    @staticmethod
    def _pairing(name: str, t: Tensor, cfg: ModelConfig, permutation) -> Tensor:
        """Reorder each head's dims of a q/k projection (rows) or QK-norm weight."""
        if cfg.rope.pairing != "interleaved" or not PAIRED.search(name):
            return t
        index = permutation(cfg.rotary_dim, cfg.head_dim)
        return t.reshape(-1, cfg.head_dim, *t.shape[1:])[:, index].reshape(t.shape)


@HF_FAMILIES.register("llama")
class Llama(LlamaLike):
    model_types = ("llama",)
    architecture = "LlamaForCausalLM"
    fallback = True  # a model no family claims is reported as a Llama that cannot be

    def claims(self, cfg: ModelConfig) -> bool:
        return _all_attention(cfg) and not cfg.attention.qk_norm

    def _family_unsupported(self, cfg: ModelConfig) -> str | None:
        if cfg.attention.qk_norm:
            return "attention.qk_norm=true (Qwen3's; exported as Qwen3)"
        return None

    def to_hf_config(self, cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
        return super().to_hf_config(cfg, dtype) | {"mlp_bias": cfg.ffn.bias}


@HF_FAMILIES.register("qwen3")
class Qwen3(LlamaLike):
    model_types = ("qwen3",)
    architecture = "Qwen3ForCausalLM"
    qk_norm = True

    def claims(self, cfg: ModelConfig) -> bool:
        return _all_attention(cfg) and cfg.attention.qk_norm

    def _family_unsupported(self, cfg: ModelConfig) -> str | None:
        if not cfg.attention.qk_norm:
            return "attention.qk_norm=false (Qwen3 always has QK-norm)"
        if cfg.ffn.bias:
            return "ffn.bias=true with attention.qk_norm (Qwen3 has no MLP bias)"
        return None
