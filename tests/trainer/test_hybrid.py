"""A Gated DeltaNet hybrid trains through the trainer like a dense model: the validation loss
falls, and an interrupted run resumes to the same losses, bitwise."""

from __future__ import annotations

import dataclasses

from model.presets import load_preset
from tests.trainer.helpers import metric_rows, small_config
from trainer.app import build_training
from trainer.runtime import Ranks

ONE = Ranks(rank=0, world_size=1, local_rank=0)
HYBRID = {
    "d_model": 64,
    "n_layers": 4,
    "attention.n_heads": 4,
    "attention.n_kv_heads": 2,
    "gdn.n_heads": 2,
    "gdn.n_v_heads": 4,
    "gdn.head_dim": 16,
    "gdn.chunk_size": 16,
    "ffn.hidden": 96,
    "vocab_size": 0,
    "max_seq_len": 64,
}


def hybrid_config(dataset, steps: int):
    cfg = small_config(dataset, max_steps=steps, eval_every=steps // 2)
    cfg.model = load_preset("tiny_hybrid", HYBRID)
    cfg.trainer.precision = "fp32"
    cfg.checkpoint.every = steps // 2
    cfg.optim.lr = 1e-2
    return cfg


def test_the_hybrid_trains_and_resumes_bitwise(dataset, tmp_path):
    training = build_training(hybrid_config(dataset, 20), tmp_path / "whole", ONE)
    assert [b.attn.kind for b in training.model.layers.values()] == ["gdn", "gdn", "gdn", "gqa"]
    assert training.run() == 0
    rows = metric_rows(tmp_path / "whole")
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert val[-1] < val[0] - 0.5
    # the same 20 steps interrupted after 10: the resumed run continues bitwise
    first = build_training(hybrid_config(dataset, 20), tmp_path / "split", ONE)
    # stops at 10 with the 20-step schedule, as a preemption would
    first.loop = dataclasses.replace(first.loop, max_steps=10)
    assert first.run() == 0
    again = build_training(hybrid_config(dataset, 20), tmp_path / "split", ONE)
    assert again.step == 10 and again.run() == 0
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    resumed = {r["step"]: r["loss"] for r in metric_rows(tmp_path / "split") if "loss" in r}
    assert resumed == losses
