"""`python -m trainer.export path=<run dir or checkpoint dir> out=<dir> [dtype=bf16]`:
a training checkpoint (of either engine) -> a Hugging Face directory (config.json + safetensors) for the families
that transformers knows (Llama, Qwen3; see model/hf/).

The checkpoint holds the resolved model config (vocabulary included), so nothing else is needed;
a run directory means its newest complete checkpoint.
"""

from __future__ import annotations

import logging
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import hydra
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from data.errors import DataError
from data.manifest import Manifest
from data.tokenizer import TokenizerIdentity, load_verified_tokenizer
from model.errors import ConfigError
from model.hf import save_hf
from trainer.checkpoint import CheckpointError
from trainer.checkpoint_weights import newest_model
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


def load_for_export(path: Path) -> tuple[Path, dict, torch.nn.Module]:
    """(checkpoint, its trainer state, the model with its weights) of the newest checkpoint
    under `path` that verifies and loads; damaged ones are reported and skipped."""
    return newest_model(path, "exported")


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
