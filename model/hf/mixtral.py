"""Mixtral (`MixtralForCausalLM`): GQA attention without QK-norm and, in every layer, softmax
top-k MoE FFNs whose k selected probabilities are renormalized (model/hf/softmax_moe.py).
Checkpoints name the FFN `block_sparse_moe` with experts.{j}.w1 (gate), w3 (up), w2 (down);
transformers 5 renames it `mlp` with fused experts at load (both read here; the checkpoint
layout written). Mixtral's intermediate_size is each expert's width.
"""

from __future__ import annotations

from typing import Any, ClassVar

from model.config import ConfigError, ModelConfig, MoEConfig
from model.hf.family import HF_FAMILIES
from model.hf.softmax_moe import SoftmaxMoEFamily


@HF_FAMILIES.register("mixtral")
class Mixtral(SoftmaxMoEFamily):
    model_types = ("mixtral",)
    architecture = "MixtralForCausalLM"
    ffn_modules: ClassVar[dict[str, tuple[str, ...]]] = {"moe": ("block_sparse_moe", "mlp")}
    expert_names = ("w1", "w3", "w2")
    qk_norm = False

    def _family_checks(self, cfg: ModelConfig) -> list:
        moe, att = cfg.moe, cfg.attention
        return [
            (moe.first_k_dense > 0, lambda: f"moe.first_k_dense={moe.first_k_dense} (all MoE)"),
            (not moe.norm_topk_prob, lambda: "moe.norm_topk_prob=false (Mixtral renormalizes)"),
            (att.bias, lambda: "attention.bias=true (Mixtral has none)"),
        ]

    def _moe_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        moe = cfg.moe
        return {
            "intermediate_size": cfg.expert_hidden,
            "num_local_experts": moe.n_routed_experts,
            "num_experts_per_tok": moe.top_k,
            "router_aux_loss_coef": moe.aux_loss_coef,
            "sliding_window": None,
        }

    def _dense_hidden(self, hf: dict[str, Any]) -> int:
        return 0  # no dense layer: the FFN width rule (unused)

    def _moe_from_hf(self, hf: dict[str, Any]) -> MoEConfig:
        if hf.get("attention_bias"):
            raise ConfigError("attention_bias=true is not a Mixtral setting")
        return MoEConfig(
            n_routed_experts=hf.get("num_local_experts") or hf["num_experts"],
            top_k=hf["num_experts_per_tok"],
            expert_hidden=hf["intermediate_size"],
            norm_topk_prob=True,
            aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)),
        )
