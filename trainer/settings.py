"""The trainer's settings, composed and validated once before anything is created or started.

`python -m trainer` and `python -m launch.torchrun` call `check_settings` with the command
line's overrides before a run directory is chosen or a worker starts: Hydra's compose API builds
the config that `hydra.main` will build (conf/config.yaml typed by trainer.config.RootConfig) and
OmegaConf.to_object runs every config dataclass's rules. Hydra's own reports of a wrong type, an
unknown key or preset span 5-30 lines and exit 1; here each is a SettingsError of one line
(exit 2). The extra composition costs about 0.2 s.

Commands that run no job (`--help`, `--hydra-help`, `--cfg`, `--info`, shell completion) and
sweeps (`-m`, whose overrides are lists of values) are left to Hydra; so are `--config-path`
and `--config-dir`, which change where configs are found.
"""

from __future__ import annotations

import argparse
import dataclasses

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from data.errors import DataError
from model.errors import ConfigError
from optim.errors import OptimConfigError
from trainer.config import CONF_DIR, RootConfig, register_configs
from trainer.runtime import register_resolvers

# what the config dataclasses raise from __post_init__, and SettingsError (a ConfigError)
CONFIG_ERRORS = (ConfigError, DataError, OptimConfigError)
LISTS_SETTINGS = "`python -m trainer --cfg job` lists every setting with its default"
_NOISE = ("full_key:", "reference_type=", "object_type=", "See https://hydra.cc")


class SettingsError(ConfigError):
    """The command line's settings do not compose into a valid config."""


def hydra_args(argv: list[str]) -> argparse.Namespace:
    """The command line as `hydra.main` parses it (flags and overrides)."""
    from hydra._internal.utils import get_args_parser  # the parser hydra.main itself uses

    return get_args_parser().parse_args(argv)


def runs_a_job(args: argparse.Namespace) -> bool:
    """False for commands that only print (help, config, info, completion)."""
    shows = args.help or args.hydra_help or args.cfg or args.info or args.shell_completion
    return not (shows or args.resolve)


def is_sweep(args: argparse.Namespace) -> bool:
    modes = {o.lstrip("+") for o in args.overrides if o.lstrip("+").startswith("hydra.mode=")}
    return args.multirun or "hydra.mode=MULTIRUN" in modes


def checkable(args: argparse.Namespace) -> bool:
    """Whether check_settings composes what Hydra will (same search path, no sweep, no rerun)."""
    custom = args.config_path or args.config_dir or args.experimental_rerun
    return runs_a_job(args) and not is_sweep(args) and not custom


def check_settings(overrides: list[str], config_name: str | None = None) -> RootConfig:
    """The typed config that `python -m trainer <overrides>` trains with; a SettingsError (or
    a config dataclass's own error) with one line when anything is wrong."""
    register_configs()
    register_resolvers()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            composed = compose(config_name=config_name or "config", overrides=overrides)
        unknown = _unknown_key(composed, "")
        if unknown is not None:
            raise SettingsError(f"{unknown} is not a setting: check its spelling; {LISTS_SETTINGS}")
        return OmegaConf.to_object(composed)
    except (HydraException, OmegaConfBaseException) as err:
        raise SettingsError(one_line(err)) from None


def _unknown_key(node: DictConfig, path: str) -> str | None:
    """The first key of a typed node that its dataclass lacks: Hydra's `+group.key=value`
    appends one that OmegaConf.to_object would silently set as an attribute."""
    schema = OmegaConf.get_type(node)
    fields = (
        {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else None
    )
    for key in node:
        full = f"{path}.{key}" if path else str(key)
        if fields is not None and key not in fields:
            return full
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not (child._is_none() or child._is_missing()):
            found = _unknown_key(child, full)
            if found is not None:
                return found
    return None


def one_line(err: BaseException) -> str:
    """Hydra's or OmegaConf's report in one line, naming the key and the way to fix it."""
    if isinstance(err, MissingConfigException) and err.options and err.missing_cfg_file:
        group, _, name = err.missing_cfg_file.rpartition("/")
        if group:
            choices = ", ".join(err.options)
            return f"{group}={name} is not a preset of {group}: choose one of {choices}"
    cause = err.__cause__ if isinstance(err.__cause__, OmegaConfBaseException) else None
    inner = cause or err
    key = getattr(inner, "full_key", None)
    if isinstance(inner, ConfigAttributeError | ConfigKeyError) and key:
        owner = getattr(getattr(inner, "object_type", None), "__name__", "its group")
        return (
            f"{key} is not a setting ({owner} has no field {key.rsplit('.', 1)[-1]!r}): check "
            f"its spelling; {LISTS_SETTINGS}"
        )
    text = ": ".join(_text(e) for e in (err, cause) if e is not None)
    if isinstance(err, OverrideParseException):
        return f"{text}: write each override as key=value"
    if isinstance(err, HydraException) and cause is None:
        return text  # Hydra's own advice (an ambiguous value: a list, a string or a sweep)
    if key and key not in text:
        text += f" ({key})"
    return f"{text}; {LISTS_SETTINGS}"


def _text(err: BaseException) -> str:
    """The message's lines, without OmegaConf's type trailer and Hydra's search path."""
    kept = []
    for line in str(err).splitlines():
        line = line.strip()
        if line.startswith("Config search path"):
            break
        if line and not line.startswith(_NOISE):
            kept.append(line.rstrip("."))
    return "; ".join(kept) or type(err).__name__
