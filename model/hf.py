"""Hugging Face interop for the dense Llama family: export to, and import from, a HF model directory.
MoE models (model.moe.n_routed_experts > 0) are refused with a ConfigError.

A directory is `config.json` plus safetensors weights (one `model.safetensors`, or shards with a
`model.safetensors.index.json`), loadable by `transformers.AutoModelForCausalLM`:
  LlamaForCausalLM   pre-RMSNorm, SwiGLU, RoPE on every head dim, optional biases
  Qwen3ForCausalLM   the same plus per-head QK-norm (chosen when attention.qk_norm is on)

RoPE pairing: HF checkpoints use the half-split pairing. A model trained with interleaved pairs is
exported by permuting the rows of each head of W_q and W_k (and the QK-norm weights) with
`interleaved_to_half`, which leaves every attention score unchanged; `load_hf(..., rope_pairing=
"interleaved")` applies the inverse, so export -> import round-trips bitwise in both layouts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from model.config import (
    AttentionConfig,
    ConfigError,
    FFNConfig,
    InitConfig,
    ModelConfig,
    RopeConfig,
)
from model.rope import half_to_interleaved, interleaved_to_half
from model.transformer import Transformer, build_model

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
MAX_SHARD_BYTES = 5 * 2**30
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

# our parameter name pattern -> HF name template (the layer index is group 1)
_TO_HF = [
    (r"embed\.weight", "model.embed_tokens.weight"),
    (r"norm\.weight", "model.norm.weight"),
    (r"head\.weight", "lm_head.weight"),
    (r"layers\.(\d+)\.attn_norm\.weight", "model.layers.{}.input_layernorm.weight"),
    (r"layers\.(\d+)\.ffn_norm\.weight", "model.layers.{}.post_attention_layernorm.weight"),
    (
        r"layers\.(\d+)\.attn\.((?:q|k|v|o)_proj\.(?:weight|bias)|(?:q|k)_norm\.weight)",
        "model.layers.{}.self_attn.{}",
    ),
    (r"layers\.(\d+)\.ffn\.((?:gate|up|down)_proj\.(?:weight|bias))", "model.layers.{}.mlp.{}"),
]
_FROM_HF = [
    (r"model\.embed_tokens\.weight", "embed.weight"),
    (r"model\.norm\.weight", "norm.weight"),
    (r"lm_head\.weight", "head.weight"),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", "layers.{}.attn_norm.weight"),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "layers.{}.ffn_norm.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.(.+)", "layers.{}.attn.{}"),
    (r"model\.layers\.(\d+)\.mlp\.(.+)", "layers.{}.ffn.{}"),
]


def _rename(name: str, table: list[tuple[str, str]]) -> str | None:
    for pattern, template in table:
        match = re.fullmatch(pattern, name)
        if match:
            return template.format(*match.groups())
    return None


# ---- config ---------------------------------------------------------------------------------------


def _unsupported_option(cfg: ModelConfig) -> str | None:
    """The first option that Llama/Qwen3 cannot express, as `key=value (why)`, or None."""
    att, rope = cfg.attention, cfg.rope
    if att.kind != "gqa":
        return f"attention.kind={att.kind!r} (MLA export comes with DeepSeek-V3 MoE support)"
    other = next((kind for kind in cfg.mixer_kinds() if kind != "gqa"), None)
    if other is not None:
        return f"layer_types/layer_pattern with {other!r} layers (Llama/Qwen3 layers are all GQA)"
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
                f"{rope.theta * rope.factor ** (cfg.rotary_dim / (cfg.rotary_dim - 2)):g}; set that and no scaling)"
            ),
        ),
        (
            rope.scaling == "yarn" and rope.mscale_all_dim > 0,
            lambda: (
                f"rope.mscale_all_dim={rope.mscale_all_dim} (Llama/Qwen3 YaRN scales only cos/sin)"
            ),
        ),
        (
            att.qk_norm and cfg.ffn.bias,
            lambda: "ffn.bias=true with attention.qk_norm (Qwen3 has no MLP bias)",
        ),
    ]
    return next((describe() for bad, describe in checks if bad), None)


def hf_architecture(cfg: ModelConfig) -> str:
    """ "llama" or "qwen3"; raises ConfigError naming the first option that HF cannot express."""
    if cfg.moe.enabled:
        raise ConfigError(
            f"cannot export to Hugging Face: model.moe.n_routed_experts={cfg.moe.n_routed_experts}: "
            "MoE conversion is not supported (only dense Llama/Qwen3 models export)"
        )
    option = _unsupported_option(cfg)
    if option is not None:
        raise ConfigError(
            f"cannot export to Hugging Face: model.{option} has no Llama/Qwen3 equivalent"
        )
    return "qwen3" if cfg.attention.qk_norm else "llama"


def _hf_max_positions(cfg: ModelConfig) -> int:
    """HF's max_position_embeddings: dynamic NTK reads it as the original length, and transformers
    4.x derives YaRN's factor from it (max_position_embeddings / original), so write factor x original."""
    if cfg.rope.scaling == "dynamic_ntk":
        return cfg.rope_original_max_seq_len
    if cfg.rope.scaling == "yarn":
        return round(cfg.rope.factor * cfg.rope_original_max_seq_len)
    return cfg.max_seq_len


def hf_config(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    arch = hf_architecture(cfg)
    out: dict[str, Any] = {
        "architectures": ["Qwen3ForCausalLM" if arch == "qwen3" else "LlamaForCausalLM"],
        "model_type": arch,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.attention.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": _hf_max_positions(cfg),
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": cfg.attention.bias,
        "rope_theta": cfg.rope.theta,
        "rope_scaling": _rope_scaling(cfg.rope),
        "torch_dtype": DTYPE_NAMES[dtype],
        "initializer_range": cfg.init.std,
    }
    if arch == "llama":
        out["mlp_bias"] = cfg.ffn.bias
    return out


def _rope_scaling(rope: RopeConfig) -> dict[str, Any] | None:
    if rope.scaling == "none":
        return None
    out: dict[str, Any] = {"rope_type": ROPE_TYPES[rope.scaling]}
    for ours, theirs in ROPE_FIELDS[rope.scaling].items():
        value = getattr(rope, ours)
        if value:  # 0 means "unset" for the optional YaRN fields
            out[theirs] = value
    return out


def config_from_hf(hf: dict[str, Any], rope_pairing: str = "half") -> ModelConfig:
    """ModelConfig for a Llama or Qwen3 `config.json` (legacy rope_scaling or v5 rope_parameters)."""
    arch = hf.get("model_type")
    if arch not in ("llama", "qwen3"):
        raise ConfigError(
            f"model_type={arch!r} is not supported for import; supported: llama, qwen3"
        )
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(
            f"partial_rotary_factor={hf['partial_rotary_factor']} is not supported for import"
        )
    if hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or []):
        raise ConfigError(
            "sliding-window layers (use_sliding_window / layer_types) are not supported for import"
        )
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act={hf['hidden_act']!r} is not supported (SwiGLU needs silu)")
    heads = hf["num_attention_heads"]
    rope, max_seq_len = _rope_from_hf(hf, rope_pairing)
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
            qk_norm=arch == "qwen3",
            bias=bool(hf.get("attention_bias", False)),
        ),
        ffn=FFNConfig(
            kind="swiglu", hidden=hf["intermediate_size"], bias=bool(hf.get("mlp_bias", False))
        ),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init=InitConfig(std=float(hf.get("initializer_range", 0.02))),
    )


def _rope_from_hf(hf: dict[str, Any], pairing: str) -> tuple[RopeConfig, int]:
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or hf.get("rope_theta", 10000.0)
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
    return RopeConfig(theta=float(theta), pairing=pairing, scaling=scaling, **fields), max_seq_len


# ---- weights --------------------------------------------------------------------------------------


def _permute_heads(t: Tensor, head_dim: int, index: Tensor) -> Tensor:
    """Reorder each head's dims of a q/k projection (rows) or QK-norm weight with `index`."""
    return t.reshape(-1, head_dim, *t.shape[1:])[:, index].reshape(t.shape)


def _pairing_fix(name: str, t: Tensor, cfg: ModelConfig, index: Tensor) -> Tensor:
    if re.search(r"attn\.(q|k)_(proj\.(weight|bias)|norm\.weight)$", name):
        return _permute_heads(t, cfg.head_dim, index)
    return t


def to_hf_state_dict(model: Transformer) -> dict[str, Tensor]:
    cfg = model.cfg
    hf_architecture(cfg)
    index = interleaved_to_half(cfg.rotary_dim, cfg.head_dim)
    out = {}
    for name, tensor in model.state_dict().items():
        hf_name = _rename(name, _TO_HF)
        if hf_name is None:
            raise ConfigError(f"parameter {name!r} has no Hugging Face counterpart")
        if cfg.rope.pairing == "interleaved":
            tensor = _pairing_fix(name, tensor, cfg, index)
        out[hf_name] = tensor
    return out


def from_hf_state_dict(hf_state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    index = half_to_interleaved(cfg.rotary_dim, cfg.head_dim)
    out, unknown = {}, []
    for hf_name, tensor in hf_state.items():
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue  # old checkpoints saved RoPE frequencies; we recompute them
        name = _rename(hf_name, _FROM_HF)
        if name is None:
            unknown.append(hf_name)
            continue
        if cfg.rope.pairing == "interleaved":
            tensor = _pairing_fix(name, tensor, cfg, index)
        out[name] = tensor
    if unknown:
        raise ConfigError(f"unexpected tensors in the checkpoint: {', '.join(unknown[:5])}")
    if cfg.tie_embeddings:
        out.pop("head.weight", None)
    return out


# ---- directories ----------------------------------------------------------------------------------


def save_hf(
    model: Transformer,
    out_dir: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Write config.json + safetensors to `out_dir` atomically (a temporary sibling, then rename)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} exists; pass overwrite=True or choose another directory")
    state = to_hf_state_dict(model)
    dtype = dtype or next(iter(state.values())).dtype
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in state.items()}
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(hf_config(model.cfg, dtype), indent=2) + "\n")
        _write_shards(state, tmp, max_shard_bytes)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _write_shards(state: dict[str, Tensor], directory: Path, max_shard_bytes: int) -> None:
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], directory / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, directory / filename, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, filename))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def read_hf_state_dict(path: str | os.PathLike) -> dict[str, Tensor]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(
            f"{path} has neither model.safetensors nor model.safetensors.index.json"
        )
    state: dict[str, Tensor] = {}
    for filename in files:
        state.update(load_file(path / filename))
    return state


def load_hf(
    path: str | os.PathLike,
    *,
    rope_pairing: str = "half",
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> Transformer:
    """A Transformer initialized from a HF Llama/Qwen3 directory (optionally in interleaved layout)."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: not a Hugging Face model directory")
    cfg = config_from_hf(json.loads(config_file.read_text()), rope_pairing)
    state = from_hf_state_dict(read_hf_state_dict(path), cfg)
    model = build_model(cfg, device="meta")
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ConfigError(
            f"checkpoint does not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    return model.to(device=device, dtype=dtype) if dtype else model.to(device)
