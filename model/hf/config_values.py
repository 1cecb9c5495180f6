"""The types of the `config.json` values that the family adapters read, checked before they read
them: a hand-edited or damaged value (`"num_hidden_layers": "two"`) is then a ConfigError naming
the key, instead of a TypeError deep inside a model config. Every value may be null (the
adapters' defaults apply); keys not listed here are not read, or are read as their own type."""

from __future__ import annotations

from typing import Any

from model.config import ConfigError

COUNTS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "num_experts_per_tok",
    "num_experts", "num_local_experts", "n_routed_experts", "n_shared_experts", "n_group",
    "topk_group", "moe_intermediate_size", "shared_expert_intermediate_size",
    "first_k_dense_replace", "moe_layer_freq", "decoder_sparse_step", "full_attention_interval",
    "sliding_window", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
    "v_head_dim", "linear_conv_kernel_dim", "linear_num_value_heads", "linear_num_key_heads",
    "linear_num_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_head_dim",
    "num_nextn_predict_layers", "num_mtp_layers",
)  # fmt: skip
NUMBERS = (
    "rms_norm_eps", "initializer_range", "rope_theta", "partial_rotary_factor",
    "routed_scaling_factor", "router_aux_loss_coef", "router_jitter_noise",
)  # fmt: skip
FLAGS = (
    "attention_bias", "mlp_bias", "tie_word_embeddings", "norm_topk_prob", "use_sliding_window",
    "rope_interleave", "mla_use_nope",
)  # fmt: skip
OTHERS = {
    "model_type": str, "hidden_act": str, "moe_router_activation_func": str,
    "layer_types": list, "mlp_layer_types": list, "mlp_only_layers": list,
    "rope_parameters": dict, "rope_scaling": dict, "linear_attn_config": dict, "text_config": dict,
}  # fmt: skip


def check_value_types(hf: dict[str, Any], where: str = "") -> None:
    """Raise a ConfigError naming the first key of `hf` (or of its text_config) whose value
    has the wrong type."""
    for key, value in hf.items():
        if value is None:
            continue
        if key in COUNTS and not _is_count(value):
            raise ConfigError(f"{where}{key}={value!r} is not a whole number >= 0")
        if key in NUMBERS and not _is_number(value):
            raise ConfigError(f"{where}{key}={value!r} is not a number")
        if key in FLAGS and not isinstance(value, bool):
            raise ConfigError(f"{where}{key}={value!r} is not true or false")
        kind = OTHERS.get(key)
        if kind is not None and not isinstance(value, kind):
            raise ConfigError(f"{where}{key}={value!r} is not a JSON {_json_name(kind)}")
    if isinstance(hf.get("text_config"), dict):
        check_value_types(hf["text_config"], f"{where}text_config.")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _json_name(kind: type) -> str:
    return {str: "string", list: "list", dict: "object"}[kind]
