"""RoPE settings in Hugging Face configs (legacy `rope_scaling` or v5 `rope_parameters`), shared
by the families that use RoPE."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from model.config import ConfigError, ModelConfig, RopeConfig

ROPE_TYPES = {
    "none": "default",
    "linear": "linear",
    "dynamic_ntk": "dynamic",
    "yarn": "yarn",
    "llama3": "llama3",
}
ROPE_FIELDS = {  # our RopeConfig field -> HF rope_scaling key, per scaling kind
    "linear": {"factor": "factor"},
    "dynamic_ntk": {"factor": "factor"},
    "yarn": {
        "factor": "factor",
        "original_max_seq_len": "original_max_position_embeddings",
        "beta_fast": "beta_fast",
        "beta_slow": "beta_slow",
        "mscale": "mscale",
        "mscale_all_dim": "mscale_all_dim",
        "attention_factor": "attention_factor",
    },
    "llama3": {
        "factor": "factor",
        "original_max_seq_len": "original_max_position_embeddings",
        "low_freq_factor": "low_freq_factor",
        "high_freq_factor": "high_freq_factor",
    },
}

IGNORABLE_ROPE_KEYS = {"partial_rotary_factor": 1.0, "truncate": True}  # HF keys at their defaults


def hf_max_positions(cfg: ModelConfig) -> int:
    """HF's max_position_embeddings: dynamic NTK reads it as the original length, and transformers
    4.x derives YaRN's factor from it (max_position_embeddings / original), so write factor x original."""
    if cfg.rope.scaling == "dynamic_ntk":
        return cfg.rope_original_max_seq_len
    if cfg.rope.scaling == "yarn":
        return round(cfg.rope.factor * cfg.rope_original_max_seq_len)
    return cfg.max_seq_len


def rope_scaling(rope: RopeConfig) -> dict[str, Any] | None:
    if rope.scaling == "none":
        return None
    out: dict[str, Any] = {"rope_type": ROPE_TYPES[rope.scaling]}
    for ours, theirs in ROPE_FIELDS[rope.scaling].items():
        value = getattr(rope, ours)
        if value:  # 0 means "unset" for the optional YaRN fields
            out[theirs] = value
    return out


def rope_from_hf(
    hf: dict[str, Any], pairing: str, partial: bool = False, ignored: tuple[str, ...] = ()
) -> tuple[RopeConfig, int]:
    """(RopeConfig, max_seq_len). `partial`: the family rotates part of each head
    (`partial_rotary_factor`, top level or in the rope parameters); `ignored`: keys that do
    not change a text model's rotation (Qwen3.5's multimodal `mrope_section`)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or hf.get("rope_theta", 10000.0)
    fraction = 1.0
    if partial:
        fraction = params.pop("partial_rotary_factor", None) or hf.get("partial_rotary_factor", 1.0)
    for key in ignored:
        params.pop(key, None)
    kind = params.pop("rope_type", params.pop("type", "default"))
    scaling = {v: k for k, v in ROPE_TYPES.items()}.get(kind)
    if scaling is None:
        raise ConfigError(
            f"rope_type={kind!r} is not supported; supported: {', '.join(ROPE_TYPES.values())}"
        )
    mapped = ROPE_FIELDS.get(scaling, {})
    fields = {
        ours: params.pop(theirs)
        for ours, theirs in mapped.items()
        if params.get(theirs) is not None
    }
    for key, value in params.items():  # anything left must be at its default, or we would drop it
        if value is not None and IGNORABLE_ROPE_KEYS.get(key, object()) != value:
            raise ConfigError(
                f"rope parameter {key}={value!r} (rope_type={kind!r}) is not supported for import"
            )
    max_seq_len = hf["max_position_embeddings"]
    if scaling == "dynamic_ntk":  # HF's max_position_embeddings is the original length here
        fields["original_max_seq_len"] = max_seq_len
    rope = RopeConfig(
        theta=float(theta), pairing=pairing, scaling=scaling, fraction=float(fraction), **fields
    )
    return rope, max_seq_len


def rope_rows(t: Tensor, cfg: ModelConfig, permutation: Callable[[int, int], Tensor]) -> Tensor:
    """Each head's dims (rows of a q/k projection, or a QK-norm gain) reordered from our RoPE
    pairing to HF's half split (`interleaved_to_half`) or back (`half_to_interleaved`); a
    no-op for models trained in the half layout."""
    if cfg.rope.pairing != "interleaved":
        return t
    index = permutation(cfg.rotary_dim, cfg.head_dim)
    return t.reshape(-1, cfg.head_dim, *t.shape[1:])[:, index].reshape(t.shape)
