"""Structured-config registration for the Hydra app: the schema that `conf/config.yaml` is typed by.

Registering the dataclasses makes a misspelled key or a wrong type fail when the config is
composed, before any process group or file is touched. The trainer issue adds the data, optim,
trainer, checkpoint, logging and parallel groups beside `model`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.config_store import ConfigStore

from model.config import ModelConfig

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


@dataclass(kw_only=True)
class RootConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    seed: int = 0  # seeds weight init (and later data order and dropout)


def register_configs() -> None:
    ConfigStore.instance().store(name="root_schema", node=RootConfig)
