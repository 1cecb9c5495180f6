"""Helpers of the scoring tests: a small trained run with a checkpoint, and its fp32 export."""

from __future__ import annotations

from pathlib import Path

from tests.trainer.helpers import small_config
from trainer.app import train
from trainer.export import ExportConfig, export
from trainer.runtime import Ranks

ONE = Ranks(rank=0, world_size=1, local_rank=0)


def train_and_export(dataset: Path, root: Path) -> tuple[Path, Path]:
    """(a run directory with a checkpoint at step 2, its Hugging Face export in fp32) of the
    small model (data.seq_len=32, model.max_seq_len=64) on `dataset`."""
    run_dir, hf_dir = root / "run", root / "hf"
    cfg = small_config(dataset, max_steps=2)
    cfg.checkpoint.every = 2
    assert train(cfg, run_dir, ONE) == 0
    export(ExportConfig(path=str(run_dir), out=str(hf_dir), dtype="fp32"))
    return run_dir, hf_dir
