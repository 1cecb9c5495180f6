"""Hugging Face interop: export to, and import from, a HF model directory, one adapter per family.

A directory is `config.json` plus safetensors weights (one `model.safetensors`, or shards with a
`model.safetensors.index.json`), loadable by `transformers.AutoModelForCausalLM`. Families are
adapter files registered in `HF_FAMILIES` (model/hf/family.py):
  llama        LlamaForCausalLM      pre-RMSNorm, SwiGLU, RoPE on every head dim, optional biases
  qwen3        Qwen3ForCausalLM      the same plus per-head QK-norm (chosen when attention.qk_norm is on)
  qwen3_next   Qwen3NextForCausalLM  GDN + gated attention hybrids with MoE (model/hf/qwen3_next.py)
  qwen3_5      Qwen3_5ForCausalLM    the same, dense (Qwen3.5's text model)
  kimi_linear  KimiLinearForCausalLM KDA + MLA NoPE hybrids, dense or MoE (model/hf/kimi_linear.py)
  qwen3_moe    Qwen3MoeForCausalLM   Qwen3 attention + softmax top-k MoE (model/hf/qwen3_moe.py)
  mixtral      MixtralForCausalLM    GQA + softmax top-k MoE, renormalized (model/hf/mixtral.py)
  deepseek_v3  DeepseekV3ForCausalLM MLA + DeepSeekMoE (sigmoid, groups, bias), MTP (model/hf/deepseek_v3.py)
To add a family, write model/hf/<family>.py with an `HFFamily` subclass (or a `LayeredFamily`,
model/hf/layered.py, for per-layer conversion) registered under its name, and import it below.
A model no family can express is refused with a ConfigError naming the option. MTP modules travel in
DeepSeek-V3's layout with any family (model/hf/mtp_layers.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from model.config import ConfigError, ModelConfig
from model.hf import (  # noqa: F401  (the families)
    deepseek_v3,
    kimi_linear,
    llama,
    mixtral,
    mtp_layers,
    qwen3_moe,
    qwen3_next,
)
from model.hf.expert_stack import ExpertStack, materialize
from model.hf.family import (
    GLOBALS,
    HF_FAMILIES,
    HFFamily,
    family_for_config,
    family_for_hf,
    hf_part,
    our_part,
)
from model.hf.files import (
    MAX_SHARD_BYTES,
    HFWeights,
    read_hf_state_dict,
    staged_dir,
    write_hf_dir,
    write_hf_files,
)
from model.transformer import Transformer, build_model

Params = dict[str, Tensor]
Part = dict[str, Tensor | ExpertStack]
__all__ = [
    "GLOBALS",
    "HF_FAMILIES",
    "MAX_SHARD_BYTES",
    "HFFamily",
    "HFWeights",
    "config_from_hf",
    "from_hf_parts",
    "from_hf_state_dict",
    "hf_architecture",
    "hf_config",
    "load_hf",
    "our_part",
    "read_hf_state_dict",
    "save_hf",
    "save_hf_parts",
    "staged_dir",
    "to_hf_parts",
    "to_hf_state_dict",
    "write_hf_parts",
]


def hf_architecture(cfg: ModelConfig) -> str:
    """The family name ("llama", "qwen3"); raises ConfigError naming the first option that HF
    cannot express."""
    return family_for_config(cfg).model_types[0]


def hf_config(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    out = family_for_config(cfg).to_hf_config(cfg, dtype)
    if cfg.mtp.depth:  # DeepSeek-V3's key (model/hf/mtp_layers.py)
        out["num_nextn_predict_layers"] = cfg.mtp.depth
    return out


def config_from_hf(hf: dict[str, Any], rope_pairing: str = "half") -> ModelConfig:
    """ModelConfig for a `config.json` of a registered family (legacy rope_scaling or v5
    rope_parameters), with its MTP depth."""
    return mtp_layers.with_depth(family_for_hf(hf).from_hf_config(hf, rope_pairing), hf)


def to_hf_state_dict(model: Transformer) -> dict[str, Tensor]:
    return mtp_layers.to_hf(family_for_config(model.cfg), dict(model.state_dict()), model.cfg)


def from_hf_state_dict(
    hf_state: dict[str, Tensor],
    cfg: ModelConfig,
    family: HFFamily | None = None,
    part: int | None = None,
) -> dict[str, Tensor]:
    """HF's tensors (the whole state dict, or the tensors of one part: model/hf/family.py) in
    our names; a ConfigError names tensors that have no counterpart. A part's expert weights
    may be `ExpertStack`s (model/hf/expert_stack.py), whose consumer reads its own experts."""
    family = family or family_for_config(cfg)
    # old checkpoints saved RoPE frequencies; we recompute them
    kept = {n: t for n, t in hf_state.items() if not n.endswith("rotary_emb.inv_freq")}
    out, unknown = mtp_layers.from_hf(family, kept, cfg, part)
    if unknown:
        raise ConfigError(f"unexpected tensors in the checkpoint: {', '.join(unknown[:5])}")
    if cfg.tie_embeddings:
        out.pop("head.weight", None)
    if part is None:  # whole tensors; a part's expert stacks are stacked as their reader cuts them
        out = {name: materialize(t) for name, t in out.items()}
    return out


def from_hf_parts(weights: HFWeights, cfg: ModelConfig, family: HFFamily) -> Iterator[Part]:
    """Our weights from a Hugging Face directory, converted part by part (the embedding, final
    norm and head; then each layer): a part's tensors are memory-mapped while the consumer
    uses it and released after, so a process holds one layer at a time, and of tensors that
    convert unchanged (the embedding, the head, most projections) and of per-expert matrices
    (`ExpertStack`s) only the rows and experts it reads."""
    by_part: dict[int, list[str]] = {}
    for name in weights.names():
        by_part.setdefault(hf_part(name), []).append(name)
    expected = [GLOBALS, *range(cfg.n_layers + cfg.mtp.depth)]
    if missing := [p for p in expected if p not in by_part]:
        what = (
            "no embedding, final norm or head (model.embed_tokens, model.norm, lm_head)"
            if missing[0] == GLOBALS
            else f"no tensor of layer {missing[0]} (model.layers.{missing[0]}.*)"
        )
        raise ConfigError(f"the checkpoint has {what}")
    for part in sorted(by_part):
        with weights.opened(by_part[part]) as tensors:
            converted = from_hf_state_dict(tensors, cfg, family, part)
        del tensors  # the mapped pages go with the last reference
        yield converted
        del converted  # before the next part is read (the consumer dropped its own)


def to_hf_parts(parts: Iterable[tuple[int, Params]], cfg: ModelConfig) -> Iterator[Params]:
    """HF's tensors of our weights given part by part ((part, its tensors): model/hf/family.py),
    converted one part at a time."""
    family = family_for_config(cfg)
    for part, state in parts:
        converted = mtp_layers.to_hf(family, state, cfg, part)
        del state
        yield converted
        del converted


def save_hf_parts(
    cfg: ModelConfig,
    parts: Iterable[tuple[int, Params]],
    out_dir: str | os.PathLike,
    *,
    dtype: torch.dtype,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """`save_hf` of weights streamed part by part (a sharded checkpoint read a layer at a time):
    each converted tensor goes to its place in its file as it comes, so one part is in memory
    at a time, whatever the files' size."""
    family_for_config(cfg)  # refuses what HF cannot express before touching the disk
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} exists; pass overwrite=True or choose another directory")
    with staged_dir(out_dir) as tmp:
        write_hf_parts(cfg, parts, tmp, dtype=dtype, max_shard_bytes=max_shard_bytes)
    return out_dir


def write_hf_parts(
    cfg: ModelConfig,
    parts: Iterable[tuple[int, Params]],
    directory: Path,
    *,
    dtype: torch.dtype,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> None:
    """`save_hf_parts` into an existing directory (a caller's temporary one, which the caller
    renames into place once everything else it holds is written: model/hf/files.staged_dir)."""
    family = family_for_config(cfg)
    # every tensor's name and shape in advance: the conversion of the model on the meta device
    meta = dict(build_model(cfg, device="meta").state_dict())
    layout = [(n, tuple(t.shape)) for n, t in mtp_layers.to_hf(family, meta, cfg).items()]
    write_hf_files(
        to_hf_parts(parts, cfg),
        lambda dt: hf_config(cfg, dt),
        directory,
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
        keep_fp32=family.keep_fp32,
        layout=layout,
    )


def save_hf(
    model: Transformer,
    out_dir: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Write config.json + safetensors to `out_dir` atomically (a temporary sibling, then rename)."""
    state = to_hf_state_dict(model)  # refuses what HF cannot express before touching the disk
    return write_hf_dir(
        state,
        lambda dt: hf_config(model.cfg, dt),
        out_dir,
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
        overwrite=overwrite,
        keep_fp32=family_for_config(model.cfg).keep_fp32,
    )


def load_hf(
    path: str | os.PathLike,
    *,
    rope_pairing: str = "half",
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> Transformer:
    """A Transformer initialized from a HF directory of a registered family (optionally in
    interleaved RoPE layout)."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: not a Hugging Face model directory")
    hf = json.loads(config_file.read_text())
    family = family_for_hf(hf)
    cfg = mtp_layers.with_depth(family.from_hf_config(hf, rope_pairing), hf)
    hf_state = read_hf_state_dict(path)
    cfg = mtp_layers.without_missing(cfg, hf_state)
    state = from_hf_state_dict(hf_state, cfg, family)
    model = build_model(cfg, device="meta")
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ConfigError(
            f"checkpoint does not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    _zero_statistics(model)
    # one dtype: the requested one, else the checkpoint's (zero-centred gains convert in fp32)
    return model.to(device=device, dtype=dtype or state["embed.weight"].dtype)


def _zero_statistics(model: Transformer) -> None:
    """Non-persistent buffers (MoE load statistics) are not in checkpoints: start them at zero."""
    for module in model.modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf.is_meta:
                module._buffers[name] = torch.zeros(buf.shape, dtype=buf.dtype)
