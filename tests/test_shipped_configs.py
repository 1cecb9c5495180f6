"""Every shipped YAML of every config group composes with the root config through Hydra and
validates as its typed dataclass (issue 13, item 23): a typo in any preset fails here, not in a
user's run. The launcher presets are composed in multirun mode, as `-m` uses them."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

import data.prepare  # noqa: F401  (registers `prepare_schema`)
from data.config import PrepareConfig
from trainer.config import CONF_DIR, RootConfig, register_configs
from trainer.eval import EvalCommandConfig
from trainer.export import ExportConfig
from trainer.runtime import register_resolvers

GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "hydra")
PRESETS = [(g, p.stem) for g in GROUPS for p in sorted((CONF_DIR / g).glob("*.yaml"))]
LAUNCHERS = sorted(p.stem for p in (CONF_DIR / "hydra" / "launcher").glob("*.yaml"))


@pytest.fixture(autouse=True)
def hydra_config_dir():
    register_configs()
    register_resolvers()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        yield
    GlobalHydra.instance().clear()


def test_every_group_has_presets_and_the_list_is_complete():
    assert set(GROUPS) == {"checkpoint", "data", "logging", "model", "optim", "parallel", "trainer"}
    assert len(PRESETS) >= 17 and "lmforge_slurm" in LAUNCHERS


@pytest.mark.parametrize(("group", "name"), PRESETS)
def test_every_preset_of_every_group_composes_and_validates(group: str, name: str):
    cfg = compose(config_name="config", overrides=[f"{group}={name}"])
    root = OmegaConf.to_object(cfg)  # runs every dataclass's __post_init__ checks
    assert isinstance(root, RootConfig)
    chosen = OmegaConf.to_container(OmegaConf.load(CONF_DIR / group / f"{name}.yaml"))
    section = OmegaConf.to_container(cfg[group])
    for key, value in chosen.items():  # the preset's own values arrived (defaults lists aside)
        if key != "defaults" and not isinstance(value, dict):
            assert section[key] == value, (group, name, key)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_every_launcher_preset_composes(launcher: str):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    cfg = compose(
        config_name="config",
        overrides=[f"hydra/launcher={launcher}"],
        return_hydra_config=True,
    )
    assert cfg.hydra.launcher._target_.endswith("SlurmLauncher")


@pytest.mark.parametrize(
    ("config_name", "overrides", "schema"),
    [
        ("prepare", [], PrepareConfig),
        ("export", ["path=x", "out=y"], ExportConfig),
        ("eval", ["path=x", "tasks=[piqa]"], EvalCommandConfig),
    ],
)
def test_the_other_commands_configs_compose(config_name: str, overrides: list[str], schema):
    cfg = compose(config_name=config_name, overrides=overrides)
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, schema)


def test_no_yaml_is_left_outside_the_groups():
    top = {p.name for p in CONF_DIR.glob("*.yaml")}
    assert top == {"config.yaml", "eval.yaml", "export.yaml", "prepare.yaml"}
    assert all(p.suffix == ".yaml" for p in Path(CONF_DIR).rglob("*") if p.is_file())
