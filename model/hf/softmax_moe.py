"""What the softmax-attention MoE families share (Qwen3-MoE, Mixtral): every layer GQA (RoPE over
the whole head, optional per-head QK-norm), FFNs dense or top-k softmax-routed experts without a
shared expert, per-layer conversion (model/hf/layered.py).

  attention  self_attn.{q,k,v,o}_proj (+ q_norm, k_norm): ours, rows of q/k per head in HF's
             half-split RoPE layout (converted from an interleaved-trained model, model/hf/rope.py)
  router     <moe module>.gate.weight (E, C): ours router.gate.weight; HF's has no selection bias,
             so export refuses a model whose aux-loss-free bias moved, and import sets it to zero
  experts    per expert (checkpoints) or transformers 5's fused gate_up_proj / down_proj (both
             read; per expert written): ours the stacked w_gate, w_up (E, C, F), w_down (E, F, C)
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from model.config import AttentionConfig, ConfigError, FFNConfig, InitConfig, ModelConfig, MoEConfig
from model.hf.layered import (
    DENSE_FFN,
    LayeredFamily,
    Params,
    block_checks,
    experts_from_hf,
    experts_to_hf,
    first_failing,
    optional_rename,
    pop,
    rename,
)
from model.hf.llama import gqa_hf_config
from model.hf.rope import rope_from_hf, rope_rows, rope_scaling
from model.mixers.rope import half_to_interleaved, interleaved_to_half

ATTENTION = {n: n for n in ("v_proj.weight", "o_proj.weight")}  # q, k: `_attention`
ATTENTION_BIASES = {n: n for n in ("v_proj.bias", "o_proj.bias")}


class SoftmaxMoEFamily(LayeredFamily):
    """A LayeredFamily of GQA layers and softmax-routed MoE FFNs; subclasses name the HF config
    fields and module names and add their own limits (`_family_checks`)."""

    mixer_modules: ClassVar[dict[str, str]] = {"gqa": "self_attn"}
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # per expert
    qk_norm = False  # whether the family's attention has per-head QK-norm

    def claims(self, cfg: ModelConfig) -> bool:
        all_gqa = all(kind == "gqa" for kind in cfg.mixer_kinds())
        return cfg.moe.enabled and all_gqa and cfg.attention.qk_norm == self.qk_norm

    def unsupported(self, cfg: ModelConfig) -> str | None:
        att, rope, moe = cfg.attention, cfg.rope, cfg.moe
        checks = block_checks(cfg, self.architecture, ("gqa",))
        checks += [
            (not moe.enabled, lambda: "moe.n_routed_experts=0 (a dense model: Llama / Qwen3)"),
            (att.kind != "gqa", lambda: f"attention.kind={att.kind!r} (GQA layers)"),
            (att.qk_norm != self.qk_norm, lambda: f"attention.qk_norm={att.qk_norm}"),
            (att.output_gate, lambda: "attention.output_gate=true"),
            (cfg.position != "rope", lambda: f"position={cfg.position!r} (RoPE)"),
            (rope.fraction != 1.0, lambda: f"rope.fraction={rope.fraction} (partial rotary)"),
            (rope.scaling == "ntk", lambda: "rope.scaling='ntk' (static NTK: raise rope.theta)"),
            (rope.mscale_all_dim > 0, lambda: f"rope.mscale_all_dim={rope.mscale_all_dim}"),
            (moe.score_func != "softmax", lambda: f"moe.score_func={moe.score_func!r} (softmax)"),
            (moe.n_groups > 1, lambda: f"moe.n_groups={moe.n_groups} (no group-limited routing)"),
            (moe.route_scale != 1.0, lambda: f"moe.route_scale={moe.route_scale}"),
            (moe.n_shared_experts > 0, lambda: f"moe.n_shared_experts={moe.n_shared_experts}"),
            (moe.bias_update_rate > 0, lambda: "moe.bias_update_rate>0 (the router has no bias)"),
            (moe.capacity_factor > 0, lambda: f"moe.capacity_factor={moe.capacity_factor}"),
        ]
        option = first_failing(checks + self._family_checks(cfg))
        return None if option is None else f"model.{option} has no {self.architecture} equivalent"

    def _family_checks(self, cfg: ModelConfig) -> list:
        return []

    # ---- config ---------------------------------------------------------------------------------

    def to_hf_config(self, cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
        out = self.base_hf_config(cfg, dtype) | gqa_hf_config(cfg)
        out |= {"rope_theta": cfg.rope.theta, "rope_scaling": rope_scaling(cfg.rope)}
        return out | self._moe_hf_config(cfg)

    def _moe_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        raise NotImplementedError

    def _moe_from_hf(self, hf: dict[str, Any]) -> MoEConfig:
        raise NotImplementedError

    def from_hf_config(self, hf: dict[str, Any], rope_pairing: str) -> ModelConfig:
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act={hf['hidden_act']!r} is not supported (SwiGLU: silu)")
        if self._sliding_window(hf):
            raise ConfigError(f"sliding_window={hf['sliding_window']} is not supported for import")
        if hf.get("router_jitter_noise"):
            raise ConfigError(f"router_jitter_noise={hf['router_jitter_noise']} is not supported")
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
            ffn=FFNConfig(kind="swiglu", hidden=self._dense_hidden(hf)),
            moe=self._moe_from_hf(hf),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            init=InitConfig(std=float(hf.get("initializer_range", 0.02))),
        )

    def _dense_hidden(self, hf: dict[str, Any]) -> int:
        return hf["intermediate_size"]

    def _sliding_window(self, hf: dict[str, Any]) -> int:
        """The window the checkpoint's attention uses (0: none)."""
        return hf.get("sliding_window") or 0

    # ---- weights --------------------------------------------------------------------------------

    def mixer_to_hf(self, kind: str, params: Params, cfg: ModelConfig) -> Params:
        return self._attention(params, cfg, interleaved_to_half, "")

    def mixer_from_hf(self, kind: str, params: Params, cfg: ModelConfig, where: str) -> Params:
        return self._attention(params, cfg, half_to_interleaved, where)

    def _attention(self, params: Params, cfg: ModelConfig, permutation, where: str) -> Params:
        """The same names both ways; q/k rows (and QK-norm gains) in the other RoPE layout."""
        names = ["q_proj.weight", "k_proj.weight"] + ["q_norm.weight", "k_norm.weight"] * (
            self.qk_norm
        )
        out = {n: rope_rows(pop(params, n, where), cfg, permutation) for n in names}
        biases = [n for n in ("q_proj.bias", "k_proj.bias") if n in params]
        out |= {n: rope_rows(params.pop(n), cfg, permutation) for n in biases}
        return out | rename(params, ATTENTION, where) | optional_rename(params, ATTENTION_BIASES)

    def ffn_to_hf(self, kind: str, params: Params, cfg: ModelConfig) -> Params:
        if kind == "dense":
            return rename(params, {n: n for n in DENSE_FFN})
        bias = params.pop("router.expert_bias", None)
        if bias is not None and not bias.is_meta and bias.any():  # (meta: a layout only)
            raise ConfigError(
                "the routers' expert_bias (aux-loss-free balancing) is not zero: "
                f"{self.architecture} routes without a selection bias"
            )
        out = {"gate.weight": pop(params, "router.gate.weight")}
        return out | experts_to_hf(params, self.expert_names)

    def ffn_from_hf(self, kind: str, params: Params, cfg: ModelConfig, where: str) -> Params:
        if kind == "dense":
            return rename(params, {n: n for n in DENSE_FFN}, where)
        E = cfg.moe.n_routed_experts
        out: dict[str, Tensor] = {
            "router.gate.weight": pop(params, "gate.weight", where),
            "router.expert_bias": torch.zeros(E, dtype=torch.float32),
        }
        return out | experts_from_hf(params, self.expert_names, E, where)
