"""`init_from=hf:<dir>`: continued pretraining from a Hugging Face checkpoint directory (offline).

The model is the checkpoint's: its config comes from `config.json` through the family adapters
(model/hf), and the `model=` preset does not apply. Explicit `model.*` overrides are taken when
they keep every weight's shape (sequence length, kernels, loss chunking, balancing rates, ...);
one that changes a shape is refused, naming it. The data must have been tokenized with the
checkpoint's own tokenizer (`python -m data.prepare tokenizer=hf:<dir>`), whose ids the weights
were trained on: another tokenizer is refused, naming the fix (an export of ours carries the
run's tokenizer as tokenizer.json, which reads back with the same identity). Before any engine
is built, config.json's values and the weights' shapes (from the safetensors headers) are
checked against each other on every rank: a damaged or inconsistent directory is one line
naming the file, exit 2, on all of them. The weights load into the engine's model (sharded or
not) part by part (the embedding and head, then one layer at a time, memory-mapped): every rank
converts each part to ours and keeps its shard of it, reading only its own rows of the tensors
that convert unchanged; the ranks agree on the outcome. (The DeepSpeed engine holds the whole
model on every rank until ZeRO partitions it, so it merges the parts.)
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import yaml
from torch import Tensor

from data.errors import DataError
from data.manifest import Manifest
from data.tokenizer import load_tokenizer
from model.config import ModelConfig, config_from_dict
from model.errors import ConfigError
from model.hf import HFWeights, config_from_hf, from_hf_parts
from model.hf.config_values import check_value_types
from model.hf.family import family_for_hf
from model.hf.mtp_layers import without_missing
from model.hf.weights_check import check_hf_weights
from model.presets import set_dotted
from model.transformer import build_model
from parallel.collective import worst_over_ranks

log = logging.getLogger("trainer")
PREFIX = "hf:"


def is_hf(init_from: str) -> bool:
    return init_from.startswith(PREFIX)


def hf_directory(init_from: str) -> Path:
    directory = Path(init_from[len(PREFIX) :]).expanduser()
    if not (directory / "config.json").is_file():
        raise ConfigError(
            f"init_from={init_from}: {directory} has no config.json (a Hugging Face model "
            "directory: config.json + safetensors)"
        )
    return directory


def hf_model_config(init_from: str, manifest: Manifest, overrides: list[str]) -> ModelConfig:
    """The checkpoint's model config with the run's shape-keeping `model.*` overrides, checked
    against the data's tokenizer and against the weights' shapes (from the safetensors headers:
    a mismatch is refused here, before any engine is built). Every rank checks; they agree on
    the outcome, so a problem is one ConfigError (exit 2) on all of them."""
    problem, cfg = "", None
    try:
        cfg = _checked_config(init_from, manifest, overrides)
    except ConfigError as err:
        problem = str(err)
    failed, problem = worst_over_ranks(int(bool(problem)), problem)  # the finder's words
    if failed:
        raise ConfigError(problem)
    return cfg


def _checked_config(init_from: str, manifest: Manifest, overrides: list[str]) -> ModelConfig:
    directory = hf_directory(init_from)
    hf = read_hf_config(directory, init_from)
    try:
        weights = HFWeights(directory)
        base = without_missing(_config_from_hf(hf, directory), weights.names())
        cfg = _with_overrides(base, overrides, init_from)
        check_hf_weights(weights, cfg, family_for_hf(hf))
    except (OSError, ValueError) as err:  # (ConfigError too) a damaged file or a mismatch, named
        message = str(err)
        prefix = "" if message.startswith("init_from=") else f"init_from={init_from}: "
        raise ConfigError(prefix + message) from None
    _check_tokenizer(directory, manifest, init_from)
    if manifest.vocab_size > cfg.vocab_size:
        raise ConfigError(
            f"init_from={init_from}: the data's tokenizer has {manifest.vocab_size} ids, the "
            f"checkpoint's embedding {cfg.vocab_size}"
        )
    return cfg


def read_hf_config(directory: Path, init_from: str) -> dict:
    """config.json as a dict; one that is not a JSON object is a ConfigError naming it."""
    path = directory / "config.json"
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"init_from={init_from}: {path} cannot be read as JSON ({err})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"init_from={init_from}: {path} is not a JSON object")
    return hf


def _config_from_hf(hf: dict, directory: Path) -> ModelConfig:
    """config_from_hf, with what a damaged or hand-edited config.json raises named in one line."""
    where = directory / "config.json"
    try:
        check_value_types(hf)
        return config_from_hf(hf)
    except KeyError as err:
        raise ConfigError(
            f"{where} has no {err.args[0]!r}, which a {hf.get('model_type')} config needs"
        ) from None
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
    except (TypeError, ValueError, AttributeError, ZeroDivisionError) as err:
        raise ConfigError(
            f"{where} holds a malformed value ({type(err).__name__}: {err})"
        ) from None


def _with_overrides(base: ModelConfig, overrides: list[str], init_from: str) -> ModelConfig:
    model_keys = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") in ("model",)]
    if model_keys:
        raise ConfigError(
            f"init_from={init_from} takes the model from the checkpoint: drop {model_keys[0]}"
        )
    chosen = [o for o in overrides if o.lstrip("+").startswith("model.")]
    if not chosen:
        return base
    tree = dataclasses.asdict(base)
    for override in chosen:
        key, value = override.lstrip("+").split("=", 1)
        set_dotted(tree, key[len("model.") :], yaml.safe_load(value))
    cfg = config_from_dict(ModelConfig, tree)
    theirs, ours = _shapes(base), _shapes(cfg)
    if theirs != ours:
        changed = sorted(n for n in theirs.keys() | ours.keys() if theirs.get(n) != ours.get(n))
        raise ConfigError(
            f"init_from={init_from}: {', '.join(chosen)} change(s) the checkpoint's weights "
            f"({changed[0]}: {theirs.get(changed[0])} -> {ours.get(changed[0])}); only "
            "settings that keep every weight's shape can be overridden"
        )
    return cfg


def _shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    model = build_model(cfg, device="meta")
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _check_tokenizer(directory: Path, manifest: Manifest, init_from: str) -> None:
    try:
        theirs = load_tokenizer(f"{PREFIX}{directory}").identity
    except DataError as err:
        raise ConfigError(f"init_from={init_from}: its tokenizer cannot be used: {err}") from None
    if theirs.hash != manifest.tokenizer.hash:
        raise ConfigError(
            f"init_from={init_from}: the data ({manifest.root}) was tokenized with "
            f"{manifest.tokenizer.short()}, not the checkpoint's tokenizer {theirs.short()}: "
            f"prepare it with python -m data.prepare tokenizer={PREFIX}{directory} ..."
        )


def hf_weights_reader(
    init_from: str, model_cfg: ModelConfig
) -> Callable[[], Iterator[dict[str, Tensor]]]:
    """A reader of the checkpoint's weights in our names, part by part (called on every rank
    by the engine's builder, parallel.init.load_weights): each rank holds one part at a time
    and cuts its shard from it. The ranks agree on the outcome after the last part; a problem
    is one ConfigError on all of them."""
    directory = hf_directory(init_from)

    def read() -> Iterator[dict[str, Tensor]]:
        problem = ""
        log.info("starting from the weights of %s (a Hugging Face checkpoint)", directory)
        try:
            hf = json.loads((directory / "config.json").read_text())
            weights = HFWeights(directory)
            yield from from_hf_parts(weights, model_cfg, family_for_hf(hf))
        except (ConfigError, OSError, ValueError) as err:
            problem = f"init_from={init_from}: {err}"
        failed, problem = worst_over_ranks(int(bool(problem)), problem)
        if failed:
            raise ConfigError(problem)

    return read
