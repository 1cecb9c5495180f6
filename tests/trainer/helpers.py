"""Helpers of the trainer tests: a small prepared dataset and a small, fast model/run config."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from data.config import LoaderConfig
from data.prepare import prepare
from model.presets import load_preset
from optim.config import OptimConfig
from tests.commands import run_module
from tests.data.helpers import prepare_config, write_corpus
from trainer.config import CheckpointConfig, LoggingConfig, RootConfig, TrainerConfig

SMALL_MODEL = {
    "d_model": 64,
    "n_layers": 2,
    "attention.n_heads": 4,
    "attention.n_kv_heads": 2,
    "vocab_size": 0,
    "max_seq_len": 64,
}
# the same as Hydra overrides, for the command-line tests
SMALL_OVERRIDES = [f"model.{k}={v}" for k, v in SMALL_MODEL.items()] + [
    "data.seq_len=32",
    "data.val_batches=1",
    "data.num_workers=0",
    "trainer.batch_size=4",
    "trainer.log_every=1",
    "trainer.sample_tokens=8",
    "trainer.threads=1",
    "trainer.compile=false",  # long test runs stay eager (auto compiles from 300 steps)
    "optim.warmup_steps=2",
    "logging.progress=false",
]


def make_dataset(root: Path, vocab_size: int = 300) -> Path:
    corpus = write_corpus(root / "corpus")[0].parent
    out = root / "dataset"
    prepare(prepare_config(corpus, out, "train", vocab_size=vocab_size, val_fraction=0.2))
    return out


def small_config(dataset: Path, **trainer: object) -> RootConfig:
    settings = dict(batch_size=4, log_every=1, sample_tokens=8, threads=1, eval_every=0)
    settings["compile"] = "false"  # eager, as SMALL_OVERRIDES (auto compiles 300-step runs)
    settings.update(trainer)
    return RootConfig(
        model=load_preset("tiny", SMALL_MODEL),
        data=LoaderConfig(path=str(dataset), seq_len=32, val_batches=1, num_workers=0),
        optim=OptimConfig(warmup_steps=2),
        trainer=TrainerConfig(**settings),
        checkpoint=CheckpointConfig(every=0),
        logging=LoggingConfig(progress=False),
    )


def run_trainer(*overrides: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_module("trainer", *overrides, cwd=cwd, env=env)


def metric_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> dict[int, float]:
    """Training loss by step, from a run directory's metrics.jsonl."""
    return {r["step"]: r["loss"] for r in metric_rows(run_dir) if "loss" in r}
