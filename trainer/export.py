"""`python -m trainer.export path=<run dir or checkpoint dir> out=<dir> [dtype=bf16] [max_shard_size=5GB]`:
a training checkpoint (of either engine) -> a Hugging Face directory (config.json + safetensors,
with model.safetensors.index.json when there are several files) for the families that
transformers knows (model/hf/).

Nothing is written where it could cost data (trainer/export_target.py: never over the run, the
checkpoint or the working directory; overwrite=true replaces only a previous export), and
nothing half-done is left: the export is written into a temporary sibling of `out` (the
tokenizer first, verified before any weight is written) and renamed into place at the end;
any failure removes it. Weights holding NaN or inf are refused unless allow_nonfinite=true.

The checkpoint holds the resolved model config (vocabulary included), so nothing else is needed;
a run directory means its newest checkpoint whose files verify. A sharded (DCP) checkpoint is
streamed: read a layer at a time, converted, and written into files of at most max_shard_size,
so the whole model is never in memory (DeepSpeed's checkpoints are consolidated whole).
"""

from __future__ import annotations

import json
import logging
import math
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

from data.atomic import atomic_write_json, is_disk_full
from data.errors import DataError
from data.tokenizer import Tokenizer
from model.config import ModelConfig
from model.errors import ConfigError
from model.hf import hf_architecture, staged_dir, write_hf_parts
from trainer.checkpoint.errors import CheckpointError
from trainer.checkpoint.tokenizer import TokenizerGone, checkpoint_tokenizer, tokenizer_dir
from trainer.checkpoint.weights import WeightParts, candidates, newest_weights
from trainer.config import CONF_DIR
from trainer.export_target import check_out, write_marker

log = logging.getLogger("trainer.export")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(kw_only=True)
class ExportConfig:
    path: str = ""  # a checkpoint directory (step_<N>) or a run directory (its newest one)
    out: str = ""  # the Hugging Face directory to write
    dtype: str = "bf16"  # fp32 | bf16: the dtype of the saved weights
    overwrite: bool = False  # replace an existing `out` that is a previous export
    allow_nonfinite: bool = False  # export weights holding NaN or inf (refused by default)
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
    if not math.isfinite(value) or value < 1:  # nan, inf: no size (int() of them raises)
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


def copy_tokenizer(extra: dict, out: Path, model_max_length: int | None = None) -> Tokenizer | None:
    """The training data's tokenizer, verified to be the one the checkpoint was trained with
    (returned; None when the checkpoint's is gone)."""
    try:
        tokenizer = checkpoint_tokenizer(extra)
    except TokenizerGone as gone:
        log.warning("%s: exported without a tokenizer", gone)
        return None
    shutil.copytree(tokenizer_dir(extra), out / "tokenizer", dirs_exist_ok=True)
    # and as Hugging Face's tokenizer.json + tokenizer_config.json (AutoTokenizer, init_from=hf:)
    from data.hf_tokenizer_export import write_hf_tokenizer  # (imported here: one edit)

    write_hf_tokenizer(tokenizer, out, model_max_length=model_max_length)
    return tokenizer


def write_generation_defaults(out: Path, eos_id: int) -> None:
    """The end-of-text token as the model's EOS (config.json, generation_config.json), so that
    transformers' generate() stops at a document's end as the trainer's sampler does."""
    config = json.loads((out / "config.json").read_text())
    config["eos_token_id"] = eos_id
    atomic_write_json(out / "config.json", config)
    atomic_write_json(out / "generation_config.json", {"eos_token_id": eos_id})


def finite(parts: WeightParts, ckpt: Path) -> Iterator:
    """The parts, refused at the first tensor holding NaN or inf (a diverged run's weights),
    each part checked as it is read, before it is converted."""
    for part, state in parts:
        for name, tensor in state.items():
            if tensor.is_floating_point():
                bad = tensor.numel() - int(torch.isfinite(tensor).sum())
                if bad:
                    raise CheckpointError(
                        f"{ckpt} holds non-finite weights: {name} has {bad} NaN or infinite "
                        f"values (of {tensor.numel()}); export an earlier checkpoint (path=<its "
                        f"step_ directory>) or pass allow_nonfinite=true"
                    )
        yield part, state
        del state  # before the next part is read


def export(cfg: ExportConfig) -> Path:
    source, out = Path(cfg.path).expanduser(), Path(cfg.out).expanduser()
    protected = {
        "the run or checkpoint being exported": source,
        "the working directory": Path.cwd(),
    }
    check_out(out, cfg.overwrite, protected, candidates(source))  # before anything is read
    ckpt, extra, model_cfg, parts = newest_weights(source)
    hf_architecture(model_cfg)  # a model HF cannot express: refused before anything is written
    parts = _with_progress(parts, model_cfg)
    if not cfg.allow_nonfinite:
        parts = finite(parts, ckpt)
    with staged_dir(out) as tmp:  # renamed to `out` at the end; removed on any failure
        tokenizer = copy_tokenizer(extra, tmp, model_cfg.max_seq_len)  # before any weight
        write_hf_parts(
            model_cfg,
            parts,
            tmp,
            dtype=DTYPES[cfg.dtype],
            max_shard_bytes=_bytes(cfg.max_shard_size),
        )
        if tokenizer is not None:
            write_generation_defaults(tmp, tokenizer.eot_id)
        write_marker(tmp, ckpt, extra["step"], cfg.dtype)
    log.info("exported %s (step %d) to %s", ckpt, extra["step"], out)
    return out


def _os_problem(err: OSError, out: str) -> str:
    """One line for a file-system failure (nothing is left in `out`: the temporary is gone)."""
    if is_disk_full(err):
        return (
            f"no space left on the device of {out}: nothing was exported; free space and run "
            f"the same command again, or choose another out="
        )
    where = f" ({err.filename})" if err.filename else ""
    return f"{err.strerror or err}{where}: nothing was exported; choose an out= you can write"


ConfigStore.instance().store(name="export_schema", node=ExportConfig)


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="export")
def main(dict_cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        export(OmegaConf.to_object(dict_cfg))
    except (ConfigError, DataError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    except OSError as err:  # a read-only or full file system, a folder one may not write
        print(f"error: {_os_problem(err, dict_cfg.out)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
