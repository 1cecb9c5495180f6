"""Block Attention Residuals through the trainer: the validation loss falls, the depth-weight
metrics are logged (and move away from uniform as the pseudo-queries train), and an interrupted
run resumes to the same losses, bitwise."""

from __future__ import annotations

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


def attnres_config(dataset, steps: int):
    cfg = small_config(dataset, max_steps=steps, eval_every=steps // 2)
    cfg.model = load_preset("tiny_attnres", SMALL)
    cfg.trainer.precision = "fp32"
    cfg.checkpoint.every = steps // 2
    cfg.optim.lr = 3e-3  # at 1e-2 (the hybrid test's) this d=64 model spikes on some batches
    return cfg


def test_block_attnres_trains_logs_its_depth_weights_and_resumes_bitwise(dataset, tmp_path):
    training = build_training(attnres_config(dataset, 20), tmp_path / "whole", ONE)
    assert training.run() == 0
    rows = metric_rows(tmp_path / "whole")
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert val[-1] < val[0] - 0.5
    logged = [r for r in rows if "attnres/entropy" in r]
    assert logged and {f"attnres/layer{i}/embed_weight" for i in range(4)} <= logged[-1].keys()
    assert 0 < logged[-1]["attnres/entropy"] < 1  # the queries trained away from uniform
    first = build_training(attnres_config(dataset, 20), tmp_path / "split", ONE)
    first.cfg.trainer.max_steps = 10  # stops at 10 with the 20-step schedule, as a preemption would
    assert first.run() == 0
    again = build_training(attnres_config(dataset, 20), tmp_path / "split", ONE)
    assert again.step == 10 and again.run() == 0
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    resumed = {r["step"]: r["loss"] for r in metric_rows(tmp_path / "split") if "loss" in r}
    assert resumed == losses
