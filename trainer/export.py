"""`python -m trainer.export path=<run dir or checkpoint dir> out=<dir> [dtype=bf16]`:
a training checkpoint -> a Hugging Face directory (config.json + safetensors) for the families
that transformers knows (Llama, Qwen3; see model/hf.py).

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
import torch.distributed.checkpoint as dcp
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from model.config import ModelConfig, config_from_dict
from model.errors import ConfigError
from model.hf import save_hf
from model.transformer import build_model
from trainer.checkpoint import complete_checkpoints
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


def find_checkpoint(path: Path) -> Path:
    if (path / ".metadata").is_file():
        return path
    for root in (path / "checkpoints", path):
        found = complete_checkpoints(root)
        if found:
            return found[0]
    raise ConfigError(f"path={path} is neither a checkpoint nor a run directory with one")


def export(cfg: ExportConfig) -> Path:
    ckpt = find_checkpoint(Path(cfg.path).expanduser())
    extra = torch.load(ckpt / "trainer_rank0.pt", weights_only=False)
    model_cfg = config_from_dict(ModelConfig, extra["model_config"])
    model = build_model(model_cfg, device="cpu")
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(state, checkpoint_id=str(ckpt))
    model.load_state_dict(state["model"])
    out = Path(cfg.out).expanduser()
    save_hf(model, out, dtype=DTYPES[cfg.dtype], overwrite=cfg.overwrite)
    tokenizer = extra.get("tokenizer_dir")
    if tokenizer and Path(tokenizer).is_dir():
        shutil.copytree(tokenizer, out / "tokenizer", dirs_exist_ok=True)
    log.info("exported %s (step %d) to %s", ckpt, extra["step"], out)
    return out


ConfigStore.instance().store(name="export_schema", node=ExportConfig)


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="export")
def main(dict_cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        export(OmegaConf.to_object(dict_cfg))
    except (ConfigError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
