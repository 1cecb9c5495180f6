"""The training loop in process: learning, skipped bad steps, the stop after K of them, resume
state, and the metrics rows."""

from __future__ import annotations

import json

import pytest
import torch

from tests.trainer.helpers import metric_rows, small_config
from trainer.app import build_training, train
from trainer.checkpoint.load import load_checkpoint
from trainer.checkpoint.save import complete_checkpoints
from trainer.runtime import Ranks

ONE = Ranks(rank=0, world_size=1, local_rank=0)
REQUIRED = {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu"}


def test_training_lowers_the_validation_loss_and_logs_every_step(dataset, tmp_path):
    cfg = small_config(dataset, max_steps=30, eval_every=15)
    cfg.optim.lr = 1e-2
    assert train(cfg, tmp_path, ONE) == 0
    rows = metric_rows(tmp_path)
    train_rows = [r for r in rows if "loss" in r]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert [r["step"] for r in train_rows] == list(range(1, 31))
    assert all(set(r) >= REQUIRED for r in train_rows)
    assert train_rows[-1]["tokens"] == 30 * 4 * 32
    assert len(val) == 3 and val[-1] < val[1] < val[0] - 1.0  # evaluated at steps 0, 15, 30
    assert all(0 < r["mfu"] < 1 and r["tokens_per_s"] > 0 for r in train_rows)
    assert (tmp_path / "loss.png").stat().st_size > 1000


def test_the_starting_evaluation_is_not_counted_as_training_time(dataset, tmp_path, monkeypatch):
    """The first row's tokens/s measures its steps only: an evaluation made 3 s longer before
    step 1 leaves that window well under 3 s (its one step takes milliseconds)."""
    import time

    from trainer.loop import Training

    original = Training._evaluate

    def slow_evaluate(self):
        if self.step == 0:
            time.sleep(3.0)
        return original(self)

    monkeypatch.setattr(Training, "_evaluate", slow_evaluate)
    assert train(small_config(dataset, max_steps=1), tmp_path, ONE) == 0
    first = next(r for r in metric_rows(tmp_path) if "tokens_per_s" in r)
    assert first["tokens"] / first["tokens_per_s"] < 1.5


def nan_at(model, calls: set[int]):
    """Make the training loss NaN on the given training forward calls (1-based)."""
    original, count = model.forward, {"n": 0}

    def forward(*args, **kwargs):
        loss = original(*args, **kwargs)
        if not model.training:  # evaluation passes do not count
            return loss
        count["n"] += 1
        return loss * float("nan") if count["n"] in calls else loss

    model.forward = forward


def test_a_nan_loss_is_skipped_counted_and_leaves_the_weights_alone(dataset, tmp_path):
    training = build_training(small_config(dataset, max_steps=6), tmp_path, ONE)
    nan_at(training.model, {3})
    weights = []
    original_step = training.optimizer.step

    def recording_step(*a, **k):
        weights.append(training.step)
        return original_step(*a, **k)

    training.optimizer.step = recording_step
    assert training.run() == 0
    assert weights == [0, 1, 3, 4, 5]  # step index 2 (the third) made no update
    rows = [r for r in metric_rows(tmp_path) if "loss" in r]
    assert rows[2]["skipped_steps"] == 1 and rows[2]["loss"] == "nan"
    assert rows[-1]["skipped_steps"] == 1 and training.skipped_total == 1


def test_consecutive_bad_steps_stop_the_run_with_a_checkpoint_of_the_last_good_state(
    dataset, tmp_path, caplog
):
    cfg = small_config(dataset, max_steps=20, max_bad_steps=3)
    training = build_training(cfg, tmp_path, ONE)
    nan_at(training.model, set(range(3, 100)))
    good = {}
    original_step = training.optimizer.step

    def recording_step(*a, **k):
        out = original_step(*a, **k)
        good.update({n: p.detach().clone() for n, p in training.model.named_parameters()})
        return out

    training.optimizer.step = recording_step
    assert training.run() == 1
    assert "3 consecutive steps skipped (trainer.max_bad_steps=3)" in caplog.text
    (ckpt,) = complete_checkpoints(tmp_path / "checkpoints")
    assert ckpt.name == "step_00000005"
    fresh = build_training(cfg, tmp_path / "other", ONE)
    extra = load_checkpoint(ckpt, fresh.engine, rank=0)
    assert extra["skipped_total"] == 3
    for name, param in fresh.model.named_parameters():
        assert torch.equal(param, good[name]), name


def test_a_spike_is_skipped_when_spike_detection_is_on(dataset, tmp_path):
    training = build_training(small_config(dataset, max_steps=3, spike_factor=2.0), tmp_path, ONE)
    training.tracker.seen, training.tracker.mean = 50, 1.0  # an established running mean of 1.0
    assert training.run() == 0
    assert training.skipped_total == 3  # the first losses (~ln V) are far above 2 x 1.0


def test_checkpoint_extra_state_is_complete(dataset, tmp_path):
    cfg = small_config(dataset, max_steps=2)
    assert train(cfg, tmp_path, ONE) == 0
    (ckpt,) = complete_checkpoints(tmp_path / "checkpoints")
    extra = torch.load(ckpt / "trainer_rank0.pt", weights_only=False)
    assert extra["step"] == 2 and extra["tokens"] == 2 * 4 * 32
    assert extra["loader"]["position"] == 8
    assert {"python", "numpy", "torch"} <= set(extra["rng"])
    assert extra["model_config"]["vocab_size"] == 320  # 300 padded to a multiple of 64
    assert "seq_len: 32" in extra["config"]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == ckpt.name
    json.dumps(extra["loader"])  # the loader state is plain data


def test_bf16_master_weights_train_in_bf16_and_checkpoint_fp32(dataset, tmp_path):
    cfg = small_config(dataset, max_steps=20, eval_every=20, precision="bf16_master")
    cfg.optim.lr = 1e-2
    training = build_training(cfg, tmp_path, ONE)
    assert {p.dtype for p in training.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in training.state_model.parameters()} == {torch.float32}
    assert training.run() == 0
    val = [r["val_loss"] for r in metric_rows(tmp_path) if "val_loss" in r]
    assert val[-1] < val[0] - 1.0
    for param, master in training.engine.master.pairs:  # the bf16 weights are the rounded masters
        assert torch.equal(param, master.to(torch.bfloat16))
    (ckpt,) = complete_checkpoints(tmp_path / "checkpoints")
    fresh = build_training(cfg, tmp_path / "other", ONE)
    load_checkpoint(ckpt, fresh.engine, rank=0)
    for name, param in fresh.state_model.named_parameters():
        assert param.dtype == torch.float32
        assert torch.equal(param, dict(training.state_model.named_parameters())[name])


@pytest.mark.parametrize("precision", ["bf16_master", "fp32"])
def test_resume_in_process_is_bitwise_exact(dataset, tmp_path, precision):
    def config(steps: int):
        cfg = small_config(dataset, max_steps=steps, precision=precision)
        cfg.checkpoint.every = 3
        return cfg

    assert train(config(6), tmp_path / "whole", ONE) == 0
    assert train(config(3), tmp_path / "split", ONE) == 0
    assert train(config(6), tmp_path / "split", ONE) == 0  # resume=auto from step 3
    losses = [
        [r["loss"] for r in metric_rows(tmp_path / d) if "loss" in r] for d in ("whole", "split")
    ]
    assert len(losses[0]) == 6 and losses[0] == losses[1]


def test_async_checkpoints_commit_and_resume_exactly(dataset, tmp_path):
    import shutil

    def config(async_save: bool):
        cfg = small_config(dataset, max_steps=6)
        cfg.checkpoint.every, cfg.checkpoint.async_save = 2, async_save
        return cfg

    assert train(config(async_save=False), tmp_path / "sync", ONE) == 0
    assert train(config(async_save=True), tmp_path / "async", ONE) == 0
    ckpts = tmp_path / "async" / "checkpoints"
    names = [p.name for p in complete_checkpoints(ckpts)]
    assert names == ["step_00000006", "step_00000004", "step_00000002"]  # all committed
    assert not list(ckpts.glob("*.tmp"))
    shutil.rmtree(ckpts / "step_00000006")  # resume from the background-written step 4
    assert train(config(async_save=True), tmp_path / "async", ONE) == 0
    losses = [
        [r["loss"] for r in metric_rows(tmp_path / d) if "loss" in r] for d in ("sync", "async")
    ]
    assert len(losses[0]) == 6 and losses[0] == losses[1]


def test_evaluation_rows_say_what_was_evaluated_and_add_a_training_sample(
    dataset, tmp_path, caplog
):
    caplog.set_level("INFO")
    assert train(small_config(dataset, max_steps=2), tmp_path, ONE) == 0
    rows = [r for r in metric_rows(tmp_path) if "val_loss" in r]
    assert [r["step"] for r in rows] == [0, 2]
    for row in rows:
        assert row["val_windows"] == 4 and row["val_tokens"] == 4 * 32
        assert 1 <= row["val_documents"] <= 6 and row["train_eval_loss"] > 0
        assert 0 < row["eval_s"] < 60
    assert "validation: 4 windows (128 tokens) spread over the whole split" in caplog.text
    assert "the validation split holds only 6 documents" in caplog.text  # with the fix named
