"""`python -m trainer.export path=<run dir or checkpoint dir> out=<dir> [dtype=bf16]`:
a training checkpoint -> a Hugging Face directory (config.json + safetensors) for the families
that transformers knows (Llama, Qwen3; see model/hf/).

The checkpoint holds the resolved model config (vocabulary included), so nothing else is needed;
a run directory means its newest complete checkpoint.
"""

from __future__ import annotations

import logging
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import hydra
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from data.errors import DataError
from data.manifest import Manifest
from data.tokenizer import TokenizerIdentity, load_verified_tokenizer
from model.config import ModelConfig, config_from_dict
from model.errors import ConfigError
from model.hf import save_hf
from model.transformer import build_model
from trainer.checkpoint import LOAD_ERRORS, CheckpointError, complete_checkpoints
from trainer.checkpoint_load import read_checked, read_states
from trainer.config import CONF_DIR

log = logging.getLogger("trainer.export")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(kw_only=True)
class ExportConfig:
    path: str = ""  # a checkpoint directory (step_<N>) or a run directory (its newest one)
    out: str = ""  # the Hugging Face directory to write
    dtype: str = "bf16"  # fp32 | bf16: the dtype of the saved weights
    overwrite: bool = False  # replace an existing `out`

    def __post_init__(self) -> None:
        if not self.path or not self.out:
            raise ConfigError("pass path=<run dir or checkpoint dir> and out=<directory>")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r} is not one of {sorted(DTYPES)}")


def candidates(path: Path) -> list[Path]:
    """A checkpoint directory itself, or a run directory's checkpoints, newest first."""
    if (path / ".metadata").is_file():
        return [path]
    for root in (path / "checkpoints", path):
        found = complete_checkpoints(root)
        if found:
            return found
    raise ConfigError(f"path={path} is neither a checkpoint nor a run directory with one")


def load_for_export(path: Path) -> tuple[Path, dict, torch.nn.Module]:
    """(checkpoint, its trainer state, the model with its weights) of the newest checkpoint
    under `path` that verifies and loads; damaged ones are reported and skipped."""
    tried = []
    for ckpt in candidates(path):
        try:
            return (ckpt, *_load(ckpt))
        except LOAD_ERRORS as err:  # damaged, unsafe or incomplete: the one before it
            log.warning(
                "checkpoint %s cannot be exported (%s); trying the one before it", ckpt, err
            )
            tried.append(ckpt.name)
    raise CheckpointError(f"no checkpoint under {path} loads (tried {', '.join(tried)})")


def _load(ckpt: Path) -> tuple[dict, torch.nn.Module]:
    extra, metadata = read_checked(ckpt, rank=0)
    model = build_model(config_from_dict(ModelConfig, extra["model_config"]), device="cpu")
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        read_states(state, ckpt, metadata)
    model.load_state_dict(state["model"])
    return extra, model


def copy_tokenizer(extra: dict, out: Path) -> None:
    """The training data's tokenizer, verified to be the one the checkpoint was trained with."""
    directory = Path(extra.get("tokenizer_dir") or "")
    if not directory.is_dir():
        log.warning("the tokenizer %s is not there any more: exported without it", directory)
        return
    if "tokenizer" in extra:
        expected = TokenizerIdentity.from_dict(extra["tokenizer"])
    else:  # older checkpoints: the dataset's manifest says which tokenizer it was
        expected = Manifest.load(directory.parent).tokenizer
    load_verified_tokenizer(directory, expected, "the checkpoint")
    shutil.copytree(directory, out / "tokenizer", dirs_exist_ok=True)


def export(cfg: ExportConfig) -> Path:
    ckpt, extra, model = load_for_export(Path(cfg.path).expanduser())
    out = Path(cfg.out).expanduser()
    save_hf(model, out, dtype=DTYPES[cfg.dtype], overwrite=cfg.overwrite)
    copy_tokenizer(extra, out)
    log.info("exported %s (step %d) to %s", ckpt, extra["step"], out)
    return out


ConfigStore.instance().store(name="export_schema", node=ExportConfig)


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="export")
def main(dict_cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        export(OmegaConf.to_object(dict_cfg))
    except (ConfigError, DataError, CheckpointError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
