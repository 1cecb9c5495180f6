"""One source for the defaults (issue 53, section 4): the config dataclasses' field defaults.

The rule for the shipped YAML (conf/): a file never sets a key to the value that key already has
without the line, i.e. the dataclass field's default, or for a preset that extends another through
its defaults list (optim/muon.yaml on adamw) the value the parent gives it. A group's
`default.yaml` sets nothing at all (a comment only; Hydra's defaults list needs the file), and
conf/config.yaml, prepare.yaml and export.yaml set no keys of their schema (only `hydra`).
One exception, allowed here by name: a model preset may state its size (MODEL_SIZE_KEYS) even
where it equals ModelConfig's default, so that every architecture's file shows its shape.

So `python -m trainer` with no overrides trains exactly `RootConfig()` with the default presets
of config.yaml's defaults list applied on top (model=tiny; optim=adamw sets nothing): a Python user
building `RootConfig(model=load_preset("tiny"))` gets the command line's run. The same holds for
`python -m data.prepare` (PrepareConfig) and `python -m trainer.export` (ExportConfig).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

import data.prepare  # noqa: F401  (registers `prepare_schema`)
from data.config import PrepareConfig
from model.presets import load_preset
from optim.config import OptimConfig
from trainer.config import CONF_DIR, RootConfig, register_configs
from trainer.export import ExportConfig
from trainer.runtime import register_resolvers
from trainer.settings import check_settings

MODEL_SIZE_KEYS = ("d_model", "n_layers")  # a model preset may name these whatever their value
DEFAULT_PRESETS = {"model": "tiny", "optim": "adamw"}  # the groups whose default is a real preset
GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "hydra")
GROUP_FILES = [f"{g}/{p.name}" for g in GROUPS for p in sorted((CONF_DIR / g).glob("*.yaml"))]
# typed by RootConfig, ExportConfig and PrepareConfig
ROOT_FILES = ("config.yaml", "export.yaml", "prepare.yaml")


@pytest.fixture(autouse=True)
def fresh_hydra():
    register_configs()
    register_resolvers()
    GlobalHydra.instance().clear()
    yield
    GlobalHydra.instance().clear()


def load(path: Path) -> dict[str, Any]:
    return OmegaConf.to_container(OmegaConf.load(path)) or {}


def leaves(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"attention.n_heads": 4, ...}: every value of a nested mapping by its dotted key."""
    flat = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(leaves(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def inherited(group: str, name: str) -> dict[str, Any]:
    """What preset `group/name` sets, its defaults-list parents' values included."""
    own = load(CONF_DIR / group / f"{name}.yaml")
    parents = [p for p in own.pop("defaults", []) if p != "_self_"]
    merged = OmegaConf.merge(*(inherited(group, p) for p in parents), own) if parents else own
    return OmegaConf.to_container(OmegaConf.create(merged))


def value_without_the_file(group_file: str) -> dict[str, Any]:
    """Each key's value had the file not set it: the field default, or its parents' value."""
    group = group_file.split("/")[0]
    base = OmegaConf.to_container(OmegaConf.structured(RootConfig))[group]  # field defaults
    parents = [p for p in load(CONF_DIR / group_file).get("defaults", []) if p != "_self_"]
    merged = OmegaConf.merge(base, *(inherited(group, p) for p in parents))
    return leaves(OmegaConf.to_container(merged))


def same(a: Any, b: Any) -> bool:
    """Equal, also a YAML bool written for a string field (`compile: false` and "false")."""
    return a == b or str(a).lower() == str(b).lower()


def restated(values: dict[str, Any], base: dict[str, Any], allowed: tuple = ()) -> list[str]:
    """The keys of `values` that set what `base` already holds (but those `allowed`)."""
    return [
        f"{key}: {value!r}"
        for key, value in leaves(values).items()
        if key not in allowed and same(value, base[key])
    ]


@pytest.mark.parametrize("group_file", GROUP_FILES)
def test_no_group_yaml_restates_a_default(group_file: str):
    values = {k: v for k, v in load(CONF_DIR / group_file).items() if k != "defaults"}
    allowed = MODEL_SIZE_KEYS if group_file.startswith("model/") else ()
    found = restated(values, value_without_the_file(group_file), allowed)
    assert not found, f"conf/{group_file} restates the dataclass default of {found}: delete them"


@pytest.mark.parametrize("name", ROOT_FILES)
def test_the_root_yamls_set_no_schema_key(name: str):
    """config.yaml, prepare.yaml, export.yaml: groups, Hydra's settings, nothing else."""
    keys = set(load(CONF_DIR / name)) - {"defaults", "hydra"}
    assert not keys, f"conf/{name} sets {sorted(keys)}: give them as the dataclass's defaults"


def test_every_groups_default_file_sets_nothing():
    for group in GROUPS:
        path = CONF_DIR / group / "default.yaml"
        if path.exists():
            assert load(path) == {}, (
                f"conf/{group}/default.yaml sets keys: move them to the dataclass"
            )
            assert path.read_text().startswith("#")  # says why it is empty


def test_the_default_presets_are_config_yamls():
    listed = [d for d in load(CONF_DIR / "config.yaml")["defaults"] if isinstance(d, dict)]
    chosen = {k: v for d in listed for k, v in d.items() if not k.startswith("override ")}
    assert chosen == {g: DEFAULT_PRESETS.get(g, "default") for g in GROUPS}


def differences(composed: object, expected: object) -> list[str]:
    got, want = leaves(dataclasses.asdict(composed)), leaves(dataclasses.asdict(expected))
    return [
        f"{k}: YAML {got.get(k)!r}, dataclass {want.get(k)!r}"
        for k in want
        if got.get(k) != want[k]
    ]


def test_python_m_trainer_runs_the_dataclass_defaults_with_the_default_presets():
    """The bug of issue 53: `python -m trainer` trained batch 8 at seq_len 256 (the YAML),
    RootConfig() batch 16 at 512 (the dataclasses)."""
    composed = check_settings([])  # what `python -m trainer` composes (trainer/settings.py)
    optim = OptimConfig(**inherited("optim", DEFAULT_PRESETS["optim"]))
    expected = RootConfig(model=load_preset(DEFAULT_PRESETS["model"]), optim=optim)
    found = differences(composed, expected)
    assert not found, "; ".join(found)


def test_data_prepare_and_export_run_their_dataclass_defaults():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        prepare = OmegaConf.to_object(compose(config_name="prepare"))
        export = OmegaConf.to_object(compose(config_name="export", overrides=["path=x", "out=y"]))
    for found in (
        differences(prepare, PrepareConfig()),
        differences(export, ExportConfig(path="x", out="y")),
    ):
        assert not found, "; ".join(found)
