"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention (GQA with per-head QK-norm) and
softmax top-k MoE FFNs without a shared expert (model/hf/softmax_moe.py); the first k layers may
be dense (`mlp_only_layers`), the k selected probabilities optionally renormalized
(`norm_topk_prob`). Checkpoints store one matrix per expert: mlp.experts.{j}.{gate,up,down}_proj.
"""

from __future__ import annotations

from typing import Any

from model.config import ConfigError, ModelConfig, MoEConfig
from model.hf.family import HF_FAMILIES
from model.hf.softmax_moe import SoftmaxMoEFamily


@HF_FAMILIES.register("qwen3_moe")
class Qwen3Moe(SoftmaxMoEFamily):
    model_types = ("qwen3_moe",)
    architecture = "Qwen3MoeForCausalLM"
    qk_norm = True

    def _family_checks(self, cfg: ModelConfig) -> list:
        return [(cfg.ffn.bias, lambda: "ffn.bias=true (Qwen3-MoE has no MLP bias)")]

    def _moe_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        moe = cfg.moe
        return {
            "num_experts": moe.n_routed_experts,
            "num_experts_per_tok": moe.top_k,
            "moe_intermediate_size": cfg.expert_hidden,
            "norm_topk_prob": moe.norm_topk_prob,
            "router_aux_loss_coef": moe.aux_loss_coef,
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(moe.first_k_dense)),
            "use_sliding_window": False,
        }

    def _sliding_window(self, hf: dict[str, Any]) -> int:
        return (hf.get("sliding_window") or 0) if hf.get("use_sliding_window") else 0

    def _moe_from_hf(self, hf: dict[str, Any]) -> MoEConfig:
        step, dense = hf.get("decoder_sparse_step", 1), list(hf.get("mlp_only_layers") or [])
        if step != 1:
            raise ConfigError(f"decoder_sparse_step={step} is not supported (MoE in every layer)")
        if dense != list(range(len(dense))):
            raise ConfigError(
                f"mlp_only_layers={dense} is not supported (only the first k layers can be dense)"
            )
        return MoEConfig(  # (transformers 5 writes num_local_experts, checkpoints num_experts)
            n_routed_experts=hf.get("num_experts") or hf["num_local_experts"],
            top_k=hf["num_experts_per_tok"],
            expert_hidden=hf["moe_intermediate_size"],
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)),
            first_k_dense=len(dense),
        )
