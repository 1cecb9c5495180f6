"""Single-device model math: configs, layers, the Transformer LM, generation and accounting.

Importing the package registers every implementation (norms, residual streams, positions, token
mixers, FFNs) and loads the MoE layer (model.moe), so the config can validate registry keys.
"""

from model import ffn, moe, norms  # noqa: F401  (fill the registries)
from model.config import (
    AttentionConfig,
    AttnResConfig,
    ConfigError,
    FFNConfig,
    GDNConfig,
    InitConfig,
    KDAConfig,
    MHCConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    RopeConfig,
    config_from_dict,
)
from model.generate import generate
from model.mixers import attention, gdn, kda, mla, positions, rope  # noqa: F401
from model.residual import attnres, mhc, stream  # noqa: F401
from model.transformer import Transformer, build_model

__all__ = [
    "AttentionConfig",
    "AttnResConfig",
    "ConfigError",
    "FFNConfig",
    "GDNConfig",
    "InitConfig",
    "KDAConfig",
    "MHCConfig",
    "MLAConfig",
    "MoEConfig",
    "ModelConfig",
    "RopeConfig",
    "Transformer",
    "build_model",
    "config_from_dict",
    "generate",
]
