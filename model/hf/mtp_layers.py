"""MTP modules in Hugging Face checkpoints, in DeepSeek-V3's layout, for every family.

DeepSeek-V3 stores its MTP module as one more decoder layer after the L main ones
(deepseek-ai/DeepSeek-V3: README_WEIGHTS.md), and `num_nextn_predict_layers` in config.json:
    model.layers.{L + k}.enorm.weight, .hnorm.weight, .eh_proj.weight   ours: mtp.layers.{k}.*
    model.layers.{L + k}.shared_head.norm.weight                        ours: mtp.layers.{k}.norm
    model.layers.{L + k}.<the family's decoder layer names>             ours: mtp.layers.{k}.block.*
The family converts the block as it converts a main layer of the same kind (its index L + k). The
embedding and head are shared: they are not written again (DeepSeek-V3's files repeat them as
.embed_tokens and .shared_head.head, which import accepts and drops; transformers' MtpModel takes
them from the main model). transformers' CausalLM classes ignore these layers at load (the
main model's logits are unchanged); `load_hf` reads them back.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

from torch import Tensor

from model.config import ModelConfig, MTPConfig
from model.hf.family import HFFamily

CONFIG_KEYS = ("num_nextn_predict_layers", "num_mtp_layers")  # DeepSeek-V3's name, its alias
OWN = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "norm.weight": "shared_head.norm.weight",
}
SHARED = ("embed_tokens.weight", "shared_head.head.weight")  # copies of the main model's
log = logging.getLogger("model.hf")


def depth_from_hf(hf: dict[str, Any]) -> int:
    return next((int(hf[k]) for k in CONFIG_KEYS if hf.get(k)), 0)


def with_depth(cfg: ModelConfig, hf: dict[str, Any]) -> ModelConfig:
    """An imported config with the checkpoint's MTP depth."""
    depth = depth_from_hf(hf)
    return dataclasses.replace(cfg, mtp=MTPConfig(depth=depth)) if depth else cfg


def without_missing(cfg: ModelConfig, hf_names: Iterable[str]) -> ModelConfig:
    """`cfg` without MTP when the config counts MTP layers but the checkpoint holds none
    (transformers' own save_pretrained writes DeepseekV3Config's default of 1 and no MTP weights:
    its CausalLM class has no MTP module)."""
    first = f"model.layers.{cfg.n_layers}."
    if cfg.mtp.depth and not any(name.startswith(first) for name in hf_names):
        log.warning(
            "the config counts %d MTP layer(s) but the checkpoint has no weights for them: "
            "imported without MTP",
            cfg.mtp.depth,
        )
        return dataclasses.replace(cfg, mtp=MTPConfig())
    return cfg


def _stacked(cfg: ModelConfig) -> ModelConfig:
    """The main model with the MTP blocks as extra layers (the kind of the last one), no MTP."""
    kinds = cfg.mixer_kinds() + [cfg.mixer_kinds()[-1]] * cfg.mtp.depth
    return dataclasses.replace(
        cfg,
        n_layers=cfg.n_layers + cfg.mtp.depth,
        layer_types=kinds,
        layer_pattern=[],
        full_attention_every=0,
        mtp=MTPConfig(),
    )


def _gain(family: HFFamily, w: Tensor, out: bool) -> Tensor:
    convert = getattr(family, "gain_to_hf" if out else "gain_from_hf", None)
    return convert(w) if convert is not None else w


def to_hf(
    family: HFFamily, state: dict[str, Tensor], cfg: ModelConfig, part: int | None = None
) -> dict[str, Tensor]:
    """Our state dict (MTP modules included; the whole, or the tensors of `part`) -> HF's."""
    if not cfg.mtp.depth:
        return family.to_hf_state(state, cfg, part)
    L, main, own = cfg.n_layers, {}, {}
    for name, tensor in state.items():
        if not name.startswith("mtp."):
            main[name] = tensor
            continue
        k, rest = name.removeprefix("mtp.layers.").split(".", 1)
        if rest.startswith("block."):
            main[f"layers.{L + int(k)}.{rest.removeprefix('block.')}"] = tensor
        else:
            own[(int(k), rest)] = tensor
    out = family.to_hf_state(main, _stacked(cfg), part)
    for (k, rest), tensor in own.items():
        prefix = f"model.layers.{L + k}."
        if rest == "eh_proj.weight":
            out[prefix + rest] = tensor
        else:
            out[prefix + OWN[rest]] = _gain(family, tensor, out=True)
    return out


def from_hf(
    family: HFFamily, hf_state: dict[str, Tensor], cfg: ModelConfig, part: int | None = None
) -> tuple[dict[str, Tensor], list[str]]:
    """HF's state dict (the whole, or the tensors of `part`) -> (ours, the HF names with no
    counterpart)."""
    if not cfg.mtp.depth:
        return family.from_hf_state(hf_state, cfg, part)
    L, state, own = cfg.n_layers, dict(hf_state), {}
    for k in range(cfg.mtp.depth):
        prefix = f"model.layers.{L + k}."
        for shared in SHARED:
            state.pop(prefix + shared, None)
        if prefix + "eh_proj.weight" in state:
            own[f"mtp.layers.{k}.eh_proj.weight"] = state.pop(prefix + "eh_proj.weight")
        for ours, theirs in OWN.items():
            if prefix + theirs in state:
                own[f"mtp.layers.{k}.{ours}"] = _gain(family, state.pop(prefix + theirs), out=False)
    converted, unknown = family.from_hf_state(state, _stacked(cfg), part)
    out = dict(own)
    for name, tensor in converted.items():
        index = name.split(".")[1] if name.startswith("layers.") else ""
        if index.isdigit() and int(index) >= L:
            rest = name.split(".", 2)[2]
            out[f"mtp.layers.{int(index) - L}.block.{rest}"] = tensor
        else:
            out[name] = tensor
    return out, unknown
