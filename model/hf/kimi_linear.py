"""Kimi Linear (`KimiLinearForCausalLM`): Kimi Delta Attention layers (`kda`) with MLA full
layers without RoPE (`mla` with mla.nope, position none), DeepSeek-V3-style MoE FFNs (sigmoid
scores, the score-correction bias = our aux-loss-free `expert_bias`, shared experts).

Checkpoint layout (what transformers writes and reads), per decoder layer:
  self_attn (KDA)  q/k/v_proj, q/k/v_conv1d (ours: one conv over [q | k | v]), f_a_proj, f_b_proj,
                   A_log (1, 1, H, 1) (ours (H,)), dt_bias, b_proj, g_a_proj, g_b_proj, o_norm, o_proj
  self_attn (MLA)  q_proj or q_a_proj/q_a_layernorm/q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm,
                   kv_b_proj, o_proj (the latent norms' eps is 1e-6: our attention.mla.norm_eps)
  block_sparse_moe gate.weight, gate.e_score_correction_bias, experts.{j}.w1/w3/w2 (gate/up/down),
                   shared_experts.*; dense layers: mlp.gate/up/down_proj
Layer kinds come from `layer_types`, or the checkpoint's 1-indexed `linear_attn_config` lists.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from model.config import (
    AttentionConfig,
    ConfigError,
    FFNConfig,
    InitConfig,
    KDAConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
)
from model.hf.family import HF_FAMILIES
from model.hf.layered import (
    DENSE_FFN,
    LayeredFamily,
    Params,
    block_checks,
    deepseek_moe_checks,
    deepseek_moe_from_hf,
    deepseek_moe_to_hf,
    first_failing,
    layout_fields,
    optional_rename,
    pop,
    rename,
)

KIMI_MIXERS = {"kda": "linear_attention", "mla": "full_attention"}
LATENT_EPS = 1e-6  # KimiLinearRMSNorm's default, which its MLA latent norms use
EXPERT_NAMES = ("w1", "w3", "w2")  # gate, up, down
KDA = {
    n: n
    for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "b_proj.weight", "o_proj.weight")
}
KDA |= {"g_a_proj.weight": "g_a_proj.weight", "g_b_proj.weight": "g_b_proj.weight"}
KDA |= {"f_a_proj.weight": "f_a_proj.weight", "f_b_proj.weight": "f_b_proj.weight"}
KDA |= {"dt_bias": "dt_bias", "norm.weight": "o_norm.weight"}
MLA = {"kv_a_proj.weight": "kv_a_proj_with_mqa.weight", "kv_a_norm.weight": "kv_a_layernorm.weight"}
MLA |= {"kv_b_proj.weight": "kv_b_proj.weight", "o_proj.weight": "o_proj.weight"}
MLA_OPTIONAL = {  # full-rank or low-rank queries; biases with attention.bias
    "q_proj.weight": "q_proj.weight",
    "q_a_proj.weight": "q_a_proj.weight",
    "q_a_norm.weight": "q_a_layernorm.weight",
    "q_b_proj.weight": "q_b_proj.weight",
    "q_a_proj.bias": "q_a_proj.bias",
    "kv_a_proj.bias": "kv_a_proj_with_mqa.bias",
    "o_proj.bias": "o_proj.bias",
}


def _kimi_unsupported(cfg: ModelConfig) -> str | None:
    att = cfg.attention
    latent_eps = att.mla.norm_eps or cfg.norm_eps
    checks = block_checks(cfg, "Kimi Linear", tuple(KIMI_MIXERS))
    checks += [
        (att.kind != "mla", lambda: f"attention.kind={att.kind!r} (full layers are MLA)"),
        (cfg.position != "none", lambda: f"position={cfg.position!r} (Kimi Linear is NoPE)"),
        (att.output_gate, lambda: "attention.output_gate=true"),
        (
            latent_eps != LATENT_EPS,
            lambda: f"attention.mla.norm_eps={latent_eps:g} (its latent norms use {LATENT_EPS:g})",
        ),
    ]
    return first_failing(checks + deepseek_moe_checks(cfg))


def _layer_types(hf: dict[str, Any]) -> list[str]:
    n = hf["num_hidden_layers"]
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    linear = hf.get("linear_attn_config") or {}
    if "full_attn_layers" in linear and "kda_layers" in linear:  # 1-indexed in checkpoints
        types = [""] * n
        for i in linear["full_attn_layers"]:
            types[i - 1] = "full_attention"
        for i in linear["kda_layers"]:
            types[i - 1] = "linear_attention"
        return types
    return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]


def _first(hf: dict[str, Any], *names: str, default: Any = None) -> Any:
    """The first of `names` present in `hf` (configs store KimiLinearConfig's aliases)."""
    return next((hf[n] for n in names if hf.get(n) is not None), default)


@HF_FAMILIES.register("kimi_linear")
class KimiLinear(LayeredFamily):
    model_types = ("kimi_linear",)
    architecture = "KimiLinearForCausalLM"
    mixer_modules: ClassVar[dict[str, str]] = {"kda": "self_attn", "mla": "self_attn"}
    ties_on_load = False  # KimiLinearForCausalLM has no tied weights: lm_head is always stored
    # transformers' _keep_in_fp32_modules_strict for Kimi Linear
    keep_fp32 = ("e_score_correction_bias", "gate.weight", "dt_bias")
    ffn_modules: ClassVar[dict[str, tuple[str, ...]]] = {
        "dense": ("mlp", "block_sparse_moe"),
        "moe": ("block_sparse_moe", "mlp"),
    }

    def claims(self, cfg: ModelConfig) -> bool:
        return "kda" in cfg.mixer_kinds()

    def unsupported(self, cfg: ModelConfig) -> str | None:
        option = _kimi_unsupported(cfg)
        return None if option is None else f"model.{option} has no {self.architecture} equivalent"

    # ---- config ---------------------------------------------------------------------------------

    def to_hf_config(self, cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
        m, k, moe = cfg.attention.mla, cfg.kda, cfg.moe
        kinds = cfg.mixer_kinds()
        return self.base_hf_config(cfg, dtype) | {
            "num_key_value_heads": cfg.attention.n_heads,
            "kv_lora_rank": m.kv_lora_rank,
            "q_lora_rank": m.q_lora_rank or None,
            "qk_nope_head_dim": m.qk_nope_head_dim,
            "qk_rope_head_dim": m.qk_rope_head_dim,
            "v_head_dim": m.v_head_dim,
            "mla_use_nope": True,
            "model_max_length": cfg.max_seq_len,
            "layer_types": [KIMI_MIXERS[kind] for kind in kinds],
            "mlp_layer_types": [spec.ffn.replace("moe", "sparse") for spec in cfg.layer_specs()],
            "linear_attn_config": {
                "num_heads": k.n_heads,
                "head_dim": k.head_dim,
                "short_conv_kernel_size": k.conv_kernel,
                "kda_layers": [i + 1 for i, kind in enumerate(kinds) if kind == "kda"],
                "full_attn_layers": [i + 1 for i, kind in enumerate(kinds) if kind == "mla"],
            },
            "num_experts": moe.n_routed_experts,
            "num_experts_per_token": moe.top_k if moe.enabled else 1,
            "moe_intermediate_size": cfg.expert_hidden,
            "num_shared_experts": moe.n_shared_experts,
            "moe_renormalize": moe.norm_topk_prob,
            "routed_scaling_factor": moe.route_scale,
            "num_expert_group": moe.n_groups,
            "topk_group": moe.topk_groups,
            "moe_router_activation_func": "sigmoid",
            # for Moonshot's own config class (vLLM, SGLang, trust_remote_code): the same layout
            "first_k_dense_replace": moe.first_k_dense if moe.enabled else cfg.n_layers,
            "moe_layer_freq": 1,
            "use_grouped_topk": True,
            # KimiLinearConfig's defaults are Kimi's tokenizer ids (outside a smaller vocabulary)
            "pad_token_id": None,
            "bos_token_id": None,
            "eos_token_id": None,
        }

    def from_hf_config(self, hf: dict[str, Any], rope_pairing: str) -> ModelConfig:
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act={hf['hidden_act']!r} is not supported (SwiGLU: silu)")
        if not hf.get("mla_use_nope", True):
            raise ConfigError("mla_use_nope=false (MLA with RoPE in Kimi Linear) is not supported")
        activation = hf.get("moe_router_activation_func", "sigmoid")
        if activation != "sigmoid":
            raise ConfigError(f"moe_router_activation_func={activation!r} is not supported")
        types = _layer_types(hf)
        kinds = {v: k for k, v in KIMI_MIXERS.items()}
        unknown = sorted({t for t in types if t not in kinds})
        if unknown:
            raise ConfigError(
                f"layer_types {unknown} are not supported (linear_attention, full_attention)"
            )
        linear = hf.get("linear_attn_config") or {}
        return ModelConfig(
            vocab_size=hf["vocab_size"],
            d_model=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            max_seq_len=_first(hf, "model_max_length", "max_position_embeddings", default=1 << 20),
            norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            position="none",
            **layout_fields([kinds[t] for t in types], "mla"),
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
                    nope=True,
                    norm_eps=LATENT_EPS,
                ),
            ),
            kda=KDAConfig(
                n_heads=_first(linear, "num_heads", default=hf.get("linear_num_heads", 32)),
                head_dim=_first(linear, "head_dim", default=hf.get("linear_head_dim", 128)),
                conv_kernel=_first(
                    linear, "short_conv_kernel_size", default=hf.get("linear_conv_kernel_dim", 4)
                ),
            ),
            ffn=FFNConfig(kind="swiglu", hidden=hf["intermediate_size"]),
            moe=_moe_from_hf(hf),
            # KimiLinearForCausalLM never ties: its lm_head is its own (our tied export stores a copy)
            tie_embeddings=False,
            init=InitConfig(std=float(hf.get("initializer_range", 0.02))),
        )

    # ---- weights --------------------------------------------------------------------------------

    def mixer_to_hf(self, kind: str, params: Params, cfg: ModelConfig) -> Params:
        if kind == "mla":
            return rename(params, MLA) | optional_rename(params, MLA_OPTIONAL)
        H = cfg.kda.n_heads
        q, k, v = pop(params, "conv.weight").chunk(3, dim=0)
        out = {"q_conv1d.weight": q, "k_conv1d.weight": k, "v_conv1d.weight": v}
        out["A_log"] = pop(params, "A_log").reshape(1, 1, H, 1)
        return out | rename(params, KDA)

    def mixer_from_hf(self, kind: str, params: Params, cfg: ModelConfig, where: str) -> Params:
        if kind == "mla":
            out = rename(params, {v: k for k, v in MLA.items()}, where)
            return out | optional_rename(params, {v: k for k, v in MLA_OPTIONAL.items()})
        for name in ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log"):
            if f"forget_gate.{name}" in params:  # transformers' runtime names
                params[name] = params.pop(f"forget_gate.{name}")
        if "conv1d.weight" in params:
            conv = params.pop("conv1d.weight")
        else:
            conv = torch.cat([pop(params, f"{n}_conv1d.weight", where) for n in "qkv"])
        out = {"conv.weight": conv, "A_log": pop(params, "A_log", where).flatten()}
        return out | rename(params, {v: k for k, v in KDA.items()}, where)

    def ffn_to_hf(self, kind: str, params: Params, cfg: ModelConfig) -> Params:
        if kind == "dense":
            return rename(params, {n: n for n in DENSE_FFN})
        return deepseek_moe_to_hf(params, EXPERT_NAMES)

    def ffn_from_hf(self, kind: str, params: Params, cfg: ModelConfig, where: str) -> Params:
        if kind == "dense":
            return rename(params, {n: n for n in DENSE_FFN}, where)
        return deepseek_moe_from_hf(params, EXPERT_NAMES, cfg.moe.n_routed_experts, where)


def _moe_from_hf(hf: dict[str, Any]) -> MoEConfig:
    E = _first(hf, "num_experts", "num_local_experts", default=0)
    ffn_kinds = hf.get("mlp_layer_types")
    if ffn_kinds is None:
        k = hf.get("first_k_dense_replace", 1)
        ffn_kinds = ["dense" if i < k else "sparse" for i in range(hf["num_hidden_layers"])]
    dense = ffn_kinds.count("dense")
    if not E or dense == len(ffn_kinds):
        return MoEConfig()
    if ffn_kinds != ["dense"] * dense + ["sparse"] * (len(ffn_kinds) - dense):
        raise ConfigError(
            f"mlp_layer_types={ffn_kinds} is not supported (only the first k layers can be dense)"
        )
    groups = _first(hf, "num_expert_group", "n_group", default=1)
    return MoEConfig(
        n_routed_experts=E,
        top_k=_first(hf, "num_experts_per_token", "num_experts_per_tok"),
        expert_hidden=hf["moe_intermediate_size"],
        n_shared_experts=_first(hf, "num_shared_experts", "n_shared_experts", default=1),
        score_func="sigmoid",
        norm_topk_prob=bool(_first(hf, "moe_renormalize", "norm_topk_prob", default=True)),
        route_scale=float(hf.get("routed_scaling_factor", 1.0)),
        n_groups=groups,
        topk_groups=hf.get("topk_group") or groups,
        first_k_dense=dense,
    )
