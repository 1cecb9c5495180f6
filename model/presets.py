"""Named model presets (`conf/model/<name>.yaml`) and `key=value` overrides, without Hydra.

`model/` may not import Hydra (the import rules, tests/test_import_rules.py), yet `python -m model.inspect` takes the same
`model=<preset> model.<key>=<value>` overrides as the trainer. The presets are plain YAML mappings of
`ModelConfig` fields, so they load here with PyYAML and in the trainer through Hydra; a test checks
that both give the same config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from model.config import ConfigError, ModelConfig, config_from_dict

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
PRESET_DIR = CONF_DIR / "model"


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def preset_dict(name: str) -> dict[str, Any]:
    path = PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(
            f"model={name!r} is not a preset; choose one of: {', '.join(preset_names())}"
        )
    return yaml.safe_load(path.read_text()) or {}


def set_dotted(tree: dict[str, Any], dotted_key: str, value: Any) -> None:
    """tree['a']['b'] = value for 'a.b', creating the intermediate mappings."""
    *parents, leaf = dotted_key.split(".")
    for part in parents:
        node = tree.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set {dotted_key}: {part} is a value, not a group")
        tree = node
    tree[leaf] = value


def parse_value(text: str) -> Any:
    """YAML scalar parsing, with 1e-5-style floats (which YAML 1.1 reads as strings) made numbers."""
    value = yaml.safe_load(text) if text != "" else ""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def load_preset(name: str, overrides: dict[str, Any] | None = None) -> ModelConfig:
    """The preset's ModelConfig with `{"attention.n_kv_heads": 1, ...}` applied (keys below model.)."""
    tree = preset_dict(name)
    for key, value in (overrides or {}).items():
        set_dotted(tree, key, value)
    return config_from_dict(ModelConfig, tree)
