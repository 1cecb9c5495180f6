"""The per-family adapter protocol and its registry (`HF_FAMILIES`): one file per family.

A family adapter knows one transformers architecture (or a few close ones) and converts both
ways: the config (`to_hf_config` / `from_hf_config`) and every weight (`to_hf_name` /
`from_hf_name` plus per-tensor layout fixes). `unsupported(cfg)` names the first option of ours
that the family cannot express, so export fails with a message naming it. Families register
themselves with `@HF_FAMILIES.register(name)`; `model/hf/__init__.py` imports every family file.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

from model.config import ConfigError, ModelConfig
from model.hf.files import DTYPE_NAMES
from model.registry import Registry

HF_FAMILIES: Registry = Registry("Hugging Face family")
NameTable = tuple[tuple[str, str], ...]  # (regex over one side's names, template of the other's)

# A part of a model's weights, the unit of streamed conversion (export from a sharded checkpoint,
# a sharded import): the decoder layer of that index (MTP layer k: index n_layers + k, as in
# DeepSeek-V3's files), or GLOBALS, everything outside the layers (embedding, final norm, head).
# None means the whole model.
GLOBALS = -1
_HF_LAYER = re.compile(r"model\.(?:language_model\.)?layers\.(\d+)\.")
_OUR_LAYER = re.compile(r"(mtp\.)?layers\.(\d+)\.")


def hf_part(hf_name: str) -> int:
    """The part an HF tensor belongs to."""
    match = _HF_LAYER.match(hf_name)
    return int(match.group(1)) if match else GLOBALS


def our_part(name: str, n_layers: int) -> int:
    """The part one of our tensors belongs to (MTP module k: n_layers + k)."""
    match = _OUR_LAYER.match(name)
    if match is None:
        return GLOBALS
    return int(match.group(2)) + (n_layers if match.group(1) else 0)


def rename(name: str, table: NameTable) -> str | None:
    """The other side's name of `name` by the first matching pattern (groups fill the template)."""
    for pattern, template in table:
        match = re.fullmatch(pattern, name)
        if match:
            return template.format(*match.groups())
    return None


class HFFamily:
    """Base class of a family adapter (subclasses fill the tables and the config mapping)."""

    model_types: tuple[str, ...] = ()  # HF `model_type` values this adapter imports (first: export)
    architecture = ""  # the transformers class export names in `architectures`
    fallback = False  # the family whose errors are reported when no family claims a config
    keep_fp32: tuple[str, ...] = ()  # HF name suffixes stored fp32 whatever the export dtype
    to_hf_names: NameTable = ()  # our parameter names -> HF names
    from_hf_names: NameTable = ()  # HF names -> ours

    def claims(self, cfg: ModelConfig) -> bool:
        """Whether `cfg` is meant for this family (its errors are then the ones reported)."""
        return True

    def unsupported(self, cfg: ModelConfig) -> str | None:
        """The first option of `cfg` this family cannot express (`key=value (why)`), or None."""
        raise NotImplementedError

    def to_hf_config(self, cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
        raise NotImplementedError

    def base_hf_config(self, cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
        """The config.json fields every family here writes alike (SwiGLU decoders with RMSNorm)."""
        return {
            "architectures": [self.architecture],
            "model_type": self.model_types[0],
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "intermediate_size": cfg.ffn_hidden,
            "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.attention.n_heads,
            "hidden_act": "silu",
            "rms_norm_eps": cfg.norm_eps,
            "tie_word_embeddings": cfg.tie_embeddings,
            "attention_bias": cfg.attention.bias,
            "torch_dtype": DTYPE_NAMES[dtype],
            "initializer_range": cfg.init.std,
        }

    def from_hf_config(self, hf: dict[str, Any], rope_pairing: str) -> ModelConfig:
        raise NotImplementedError

    def to_hf_tensor(self, name: str, tensor: Tensor, cfg: ModelConfig) -> Tensor:
        """Layout fix of one of our tensors on its way out (e.g. RoPE pairing); default none."""
        return tensor

    def from_hf_tensor(self, name: str, tensor: Tensor, cfg: ModelConfig) -> Tensor:
        return tensor

    def to_hf_state(
        self, state: dict[str, Tensor], cfg: ModelConfig, part: int | None = None
    ) -> dict[str, Tensor]:
        """Our state dict (the whole, or only the tensors of `part`) -> HF's. Default: tensor by
        tensor through the name table and `to_hf_tensor`; families with fused or split tensors
        regroup them around this."""
        return {self.to_hf_name(n): self.to_hf_tensor(n, t, cfg) for n, t in state.items()}

    def from_hf_state(
        self, hf_state: dict[str, Tensor], cfg: ModelConfig, part: int | None = None
    ) -> tuple[dict[str, Tensor], list[str]]:
        """HF's state dict (the whole, or only the tensors of `part`) -> (ours, the HF names
        with no counterpart)."""
        out, unknown = {}, []
        for hf_name, tensor in hf_state.items():
            name = self.from_hf_name(hf_name)
            if name is None:
                unknown.append(hf_name)
            else:
                out[name] = self.from_hf_tensor(name, tensor, cfg)
        return out, unknown

    def to_hf_name(self, name: str) -> str:
        hf_name = rename(name, self.to_hf_names)
        if hf_name is None:
            raise ConfigError(f"parameter {name!r} has no Hugging Face counterpart")
        return hf_name

    def from_hf_name(self, hf_name: str) -> str | None:
        return rename(hf_name, self.from_hf_names)


def family_for_config(cfg: ModelConfig) -> HFFamily:
    """The family that can express `cfg`; else a ConfigError naming why the family it is meant
    for (the first that claims it) cannot."""
    if cfg.engram.enabled:
        raise ConfigError(
            f"cannot export to Hugging Face: model.engram.layers={cfg.engram.layers} (no "
            "transformers family has Engram memory; the training checkpoint holds the model)"
        )
    families = [HF_FAMILIES.get(name)() for name in HF_FAMILIES.names()]
    candidates = [f for f in families if f.claims(cfg)] or [f for f in families if f.fallback]
    reasons = []
    for family in candidates or families:
        reason = family.unsupported(cfg)
        if reason is None:
            return family
        reasons.append(reason)
    raise ConfigError(f"cannot export to Hugging Face: {reasons[0]}")


def family_for_hf(hf: dict[str, Any]) -> HFFamily:
    kind = hf.get("model_type")
    families = [HF_FAMILIES.get(n)() for n in HF_FAMILIES.names()]
    for family in families:
        if kind in family.model_types:
            return family
    known = ", ".join(t for f in families for t in f.model_types)
    raise ConfigError(f"model_type={kind!r} is not supported for import; supported: {known}")
