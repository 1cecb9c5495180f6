"""Block Attention Residuals and mHC through the trainer: the validation loss falls, the stream
metrics are logged (AttnRes' depth weights move away from uniform as the pseudo-queries train),
and an interrupted run resumes to the same losses, bitwise."""

from __future__ import annotations

import dataclasses

import pytest

from model.presets import load_preset
from tests.trainer.helpers import metric_rows, small_config
from trainer.app import build_training
from trainer.runtime import Ranks

ONE = Ranks(rank=0, world_size=1, local_rank=0)
SMALL = {
    "d_model": 64,
    "n_layers": 4,
    "attention.n_heads": 4,
    "attention.n_kv_heads": 2,
    "ffn.hidden": 96,
    "vocab_size": 0,
    "max_seq_len": 64,
}


def stream_config(dataset, steps: int, preset: str = "tiny_attnres"):
    cfg = small_config(dataset, max_steps=steps, eval_every=steps // 2)
    cfg.model = load_preset(preset, SMALL)
    cfg.trainer.precision = "fp32"
    cfg.checkpoint.every = steps // 2
    cfg.optim.lr = 3e-3  # at 1e-2 (the hybrid test's) this d=64 model spikes on some batches
    return cfg


@pytest.mark.parametrize(
    ("preset", "metric"),
    [("tiny_attnres", "attnres/layer{}/embed_weight"), ("tiny_mhc", "mhc/layer{}/res_diag")],
)
def test_the_stream_trains_logs_its_metrics_and_resumes_bitwise(dataset, tmp_path, preset, metric):
    training = build_training(stream_config(dataset, 20, preset), tmp_path / "whole", ONE)
    assert training.run() == 0
    rows = metric_rows(tmp_path / "whole")
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert val[-1] < val[0] - 0.5
    logged = [r for r in rows if metric.format(0) in r]
    assert logged and {metric.format(i) for i in range(4)} <= logged[-1].keys()
    if preset == "tiny_attnres":
        assert 0 < logged[-1]["attnres/entropy"] < 1  # the queries trained away from uniform
    first = build_training(stream_config(dataset, 20, preset), tmp_path / "split", ONE)
    # stops at 10 with the 20-step schedule, as a preemption would
    first.loop = dataclasses.replace(first.loop, max_steps=10)
    assert first.run() == 0
    again = build_training(stream_config(dataset, 20, preset), tmp_path / "split", ONE)
    assert again.step == 10 and again.run() == 0
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    resumed = {r["step"]: r["loss"] for r in metric_rows(tmp_path / "split") if "loss" in r}
    assert resumed == losses
