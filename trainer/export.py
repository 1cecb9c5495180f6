"""`python -m trainer.export path=<run dir or checkpoint dir> out=<dir> [dtype=bf16] [max_shard_size=5GB]`:
a training checkpoint (of either engine) -> a Hugging Face directory (config.json + safetensors,
with model.safetensors.index.json when there are several files) for the families that
transformers knows (model/hf/).

The checkpoint holds the resolved model config (vocabulary included), so nothing else is needed;
a run directory means its newest checkpoint whose files verify. A sharded (DCP) checkpoint is
streamed: read a layer at a time, converted, and written into files of at most max_shard_size,
so the whole model is never in memory (DeepSpeed's checkpoints are consolidated whole).
"""

from __future__ import annotations

import logging
import shutil
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import hydra
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from data.errors import DataError
from data.manifest import Manifest
from data.tokenizer import TokenizerIdentity, load_verified_tokenizer
from model.config import ModelConfig
from model.errors import ConfigError
from model.hf import save_hf_parts
from trainer.checkpoint import CheckpointError
from trainer.checkpoint_weights import newest_weights
from trainer.config import CONF_DIR

log = logging.getLogger("trainer.export")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(kw_only=True)
class ExportConfig:
    path: str = ""  # a checkpoint directory (step_<N>) or a run directory (its newest one)
    out: str = ""  # the Hugging Face directory to write
    dtype: str = "bf16"  # fp32 | bf16: the dtype of the saved weights
    overwrite: bool = False  # replace an existing `out`
    max_shard_size: str = (
        "5GB"  # the largest safetensors file (transformers' default), e.g. 2GB, 500MB
    )

    def __post_init__(self) -> None:
        if not self.path or not self.out:
            raise ConfigError("pass path=<run dir or checkpoint dir> and out=<directory>")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r} is not one of {sorted(DTYPES)}")
        _bytes(self.max_shard_size)


UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def _bytes(size: str) -> int:
    """ "5GB" -> 5e9 (transformers' units: KB/MB/GB decimal, KiB/MiB/GiB binary)."""
    text = str(size).strip().upper()
    unit = next((u for u in sorted(UNITS, key=len, reverse=True) if text.endswith(u)), "")
    try:
        value = float(text[: len(text) - len(unit)]) * UNITS.get(unit, 1)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"max_shard_size={size!r} is not a size like 5GB, 500MB or 2GiB")
    return int(value)


def _with_progress(parts: Iterable, cfg: ModelConfig) -> Iterator:
    """The parts, with a progress bar over them on a terminal (none is kept past its turn)."""
    total = len(parts) if isinstance(parts, list) else cfg.n_layers + cfg.mtp.depth + 1
    with tqdm(total=total, desc="exporting", unit="part", disable=None, leave=False) as bar:
        for item in parts:
            yield item
            del item
            bar.update()


def copy_tokenizer(extra: dict, out: Path) -> None:
    """The training data's tokenizer, verified to be the one the checkpoint was trained with."""
    if not extra.get("tokenizer_dir"):
        log.warning("the checkpoint names no tokenizer: exported without one")
        return
    directory = Path(extra["tokenizer_dir"])
    if not directory.is_dir():
        log.warning("the tokenizer %s is not there any more: exported without it", directory)
        return
    if "tokenizer" in extra:
        expected = TokenizerIdentity.from_dict(extra["tokenizer"])
    else:  # older checkpoints: the dataset's manifest says which tokenizer it was
        expected = Manifest.load(directory.parent).tokenizer
    tokenizer = load_verified_tokenizer(directory, expected, "the checkpoint")
    shutil.copytree(directory, out / "tokenizer", dirs_exist_ok=True)
    # and as Hugging Face's tokenizer.json + tokenizer_config.json (AutoTokenizer, init_from=hf:)
    from data.hf_tokenizer_export import write_hf_tokenizer  # (imported here: one edit)

    write_hf_tokenizer(tokenizer, out)


def export(cfg: ExportConfig) -> Path:
    ckpt, extra, model_cfg, parts = newest_weights(Path(cfg.path).expanduser())
    out = Path(cfg.out).expanduser()
    parts = _with_progress(parts, model_cfg)
    save_hf_parts(
        model_cfg,
        parts,
        out,
        dtype=DTYPES[cfg.dtype],
        max_shard_bytes=_bytes(cfg.max_shard_size),
        overwrite=cfg.overwrite,
    )
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
