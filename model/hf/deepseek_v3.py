"""DeepSeek-V3 (`DeepseekV3ForCausalLM`): MLA layers with RoPE on a slice of each head (YaRN with
the softmax mscale), the first k FFNs dense, the rest DeepSeekMoE: routed experts picked by
sigmoid scores plus a score-correction bias (ours: the aux-loss-free `expert_bias`), top-k within
the best groups, renormalized and scaled, beside always-active shared experts. MTP modules in
DeepSeek-V3's own layout (model/hf/mtp_layers.py).

Checkpoint layout, per decoder layer (names one-to-one with ours otherwise):
  self_attn  q_proj or q_a_proj/q_a_layernorm/q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm,
             kv_b_proj, o_proj; the latent norms' eps is 1e-6 (our attention.mla.norm_eps)
  mlp        dense: gate/up/down_proj; MoE: gate.weight, gate.e_score_correction_bias,
             experts.{j}.{gate,up,down}_proj (or transformers 5's fused experts), shared_experts.*
RoPE pairing: `rope_interleave` (the release: true) is our rope.pairing, with no weight change.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from model.config import (
    AttentionConfig,
    ConfigError,
    FFNConfig,
    InitConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
)
from model.hf.family import HF_FAMILIES
from model.hf.kimi_linear import MLA, MLA_OPTIONAL
from model.hf.layered import (
    DENSE_FFN,
    LayeredFamily,
    Params,
    block_checks,
    deepseek_moe_checks,
    deepseek_moe_from_hf,
    deepseek_moe_to_hf,
    first_failing,
    optional_rename,
    rename,
)
from model.hf.rope import hf_max_positions, rope_from_hf, rope_scaling

LATENT_EPS = 1e-6  # DeepseekV3RMSNorm's default, which its MLA latent norms use
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def _unsupported(cfg: ModelConfig) -> str | None:
    att, rope = cfg.attention, cfg.rope
    latent_eps = att.mla.norm_eps or cfg.norm_eps
    checks = block_checks(cfg, "DeepSeek-V3", ("mla",))
    checks += [
        (att.kind != "mla", lambda: f"attention.kind={att.kind!r} (MLA layers)"),
        (att.mla.nope, lambda: "attention.mla.nope=true (its MLA rotates the rope slice)"),
        (cfg.position != "rope", lambda: f"position={cfg.position!r} (RoPE)"),
        (att.output_gate, lambda: "attention.output_gate=true"),
        (rope.fraction != 1.0, lambda: f"rope.fraction={rope.fraction}"),
        (rope.scaling == "ntk", lambda: "rope.scaling='ntk' (static NTK: raise rope.theta)"),
        (
            latent_eps != LATENT_EPS,
            lambda: f"attention.mla.norm_eps={latent_eps:g} (its latent norms use {LATENT_EPS:g})",
        ),
    ]
    return first_failing(checks + deepseek_moe_checks(cfg))


@HF_FAMILIES.register("deepseek_v3")
class DeepseekV3(LayeredFamily):
    model_types = ("deepseek_v3",)
    architecture = "DeepseekV3ForCausalLM"
    mixer_modules: ClassVar[dict[str, str]] = {"mla": "self_attn"}
    keep_fp32 = ("e_score_correction_bias", "gate.weight")  # transformers' strict fp32 modules

    def claims(self, cfg: ModelConfig) -> bool:
        return all(kind == "mla" for kind in cfg.mixer_kinds()) and not cfg.attention.mla.nope

    def unsupported(self, cfg: ModelConfig) -> str | None:
        option = _unsupported(cfg)
        return None if option is None else f"model.{option} has no {self.architecture} equivalent"

    # ---- config ---------------------------------------------------------------------------------

    def to_hf_config(self, cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
        m, moe = cfg.attention.mla, cfg.moe
        return self.base_hf_config(cfg, dtype) | {
            "num_key_value_heads": cfg.attention.n_heads,
            "max_position_embeddings": hf_max_positions(cfg),
            "rope_theta": cfg.rope.theta,
            "rope_scaling": rope_scaling(cfg.rope),
            "rope_interleave": cfg.rope.pairing == "interleaved",
            "q_lora_rank": m.q_lora_rank or None,
            "kv_lora_rank": m.kv_lora_rank,
            "qk_nope_head_dim": m.qk_nope_head_dim,
            "qk_rope_head_dim": m.qk_rope_head_dim,
            "v_head_dim": m.v_head_dim,
            "n_routed_experts": moe.n_routed_experts,
            "num_experts_per_tok": moe.top_k,
            "moe_intermediate_size": cfg.expert_hidden,
            "n_shared_experts": moe.n_shared_experts,
            "routed_scaling_factor": moe.route_scale,
            "n_group": moe.n_groups,
            "topk_group": moe.topk_groups,
            "norm_topk_prob": moe.norm_topk_prob,
            "first_k_dense_replace": moe.first_k_dense if moe.enabled else cfg.n_layers,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "moe_layer_freq": 1,
            "num_nextn_predict_layers": cfg.mtp.depth,  # (transformers' default is 1)
        }

    def from_hf_config(self, hf: dict[str, Any], rope_pairing: str) -> ModelConfig:
        """`rope_pairing` is ignored: the checkpoint says it (`rope_interleave`)."""
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act={hf['hidden_act']!r} is not supported (SwiGLU: silu)")
        for key, expected in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            if hf.get(key, expected) != expected:
                raise ConfigError(f"{key}={hf[key]!r} is not supported ({expected})")
        if hf.get("moe_layer_freq", 1) != 1:
            raise ConfigError(f"moe_layer_freq={hf['moe_layer_freq']} is not supported (1)")
        pairing = "interleaved" if hf.get("rope_interleave", True) else "half"
        rope, max_seq_len = rope_from_hf(hf, pairing)
        norm_eps = float(hf.get("rms_norm_eps", 1e-6))
        return ModelConfig(
            vocab_size=hf["vocab_size"],
            d_model=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            max_seq_len=max_seq_len,
            norm_eps=norm_eps,
            rope=rope,
            attention=AttentionConfig(
                kind="mla",
                n_heads=hf["num_attention_heads"],
                bias=bool(hf.get("attention_bias", False)),
                mla=MLAConfig(
                    q_lora_rank=hf.get("q_lora_rank") or 0,
                    kv_lora_rank=hf["kv_lora_rank"],
                    qk_nope_head_dim=hf["qk_nope_head_dim"],
                    qk_rope_head_dim=hf["qk_rope_head_dim"],
                    v_head_dim=hf["v_head_dim"],
                    norm_eps=0.0 if norm_eps == LATENT_EPS else LATENT_EPS,
                ),
            ),
            ffn=FFNConfig(kind="swiglu", hidden=hf["intermediate_size"]),
            moe=_moe_from_hf(hf),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            init=InitConfig(std=float(hf.get("initializer_range", 0.02))),
        )

    # ---- weights --------------------------------------------------------------------------------

    def mixer_to_hf(self, kind: str, params: Params, cfg: ModelConfig) -> Params:
        return rename(params, MLA) | optional_rename(params, MLA_OPTIONAL)

    def mixer_from_hf(self, kind: str, params: Params, cfg: ModelConfig, where: str) -> Params:
        out = rename(params, {v: k for k, v in MLA.items()}, where)
        return out | optional_rename(params, {v: k for k, v in MLA_OPTIONAL.items()})

    def ffn_to_hf(self, kind: str, params: Params, cfg: ModelConfig) -> Params:
        if kind == "dense":
            return rename(params, {n: n for n in DENSE_FFN})
        return deepseek_moe_to_hf(params, EXPERT_NAMES)

    def ffn_from_hf(self, kind: str, params: Params, cfg: ModelConfig, where: str) -> Params:
        if kind == "dense":
            return rename(params, {n: n for n in DENSE_FFN}, where)
        return deepseek_moe_from_hf(params, EXPERT_NAMES, cfg.moe.n_routed_experts, where)


def _moe_from_hf(hf: dict[str, Any]) -> MoEConfig:
    E, n = hf.get("n_routed_experts") or 0, hf["num_hidden_layers"]
    dense = min(hf.get("first_k_dense_replace", 0) or 0, n)
    if not E or dense == n:
        return MoEConfig()
    groups = hf.get("n_group") or 1
    return MoEConfig(
        n_routed_experts=E,
        top_k=hf["num_experts_per_tok"],
        expert_hidden=hf["moe_intermediate_size"],
        n_shared_experts=hf.get("n_shared_experts") or 0,
        score_func="sigmoid",
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        route_scale=float(hf.get("routed_scaling_factor", 1.0)),
        n_groups=groups,
        topk_groups=hf.get("topk_group") or groups,
        first_k_dense=dense,
    )
