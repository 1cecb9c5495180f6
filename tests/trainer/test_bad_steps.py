"""A stop after a streak of bad steps keeps the checkpoint from before the streak (issue 13,
item 6), retries cannot push it out of `checkpoint.keep`, and skipped steps say why."""

from __future__ import annotations

import math
import signal

import torch

from tests.trainer.helpers import metric_rows, small_config
from tests.trainer.test_loop import nan_at
from trainer.app import build_training
from trainer.checkpoint.record import PROTECTED
from trainer.checkpoint.save import complete_checkpoints
from trainer.runtime import Ranks

ONE = Ranks(rank=0, world_size=1, local_rank=0)


def config(dataset, max_steps: int, keep: int = 1):
    cfg = small_config(dataset, max_steps=max_steps, max_bad_steps=3)
    cfg.checkpoint.every, cfg.checkpoint.keep = 2, keep
    return cfg


def test_the_stop_keeps_the_checkpoint_from_before_the_streak_protected(dataset, tmp_path, caplog):
    training = build_training(config(dataset, 20), tmp_path, ONE)
    nan_at(training.model, set(range(5, 100)))  # steps 5, 6, 7 fail: stop at 7
    assert training.run() == 1
    root = tmp_path / "checkpoints"
    assert [p.name for p in complete_checkpoints(root)] == ["step_00000004"]  # no save at 7
    assert (root / "step_00000004" / PROTECTED).is_file()
    assert "The last good checkpoint is" in caplog.text and "step_00000004" in caplog.text
    assert "before the first skipped step 5" in caplog.text

    # a retry: two good steps (a scheduled save at 6), then the streak again
    retry = build_training(config(dataset, 20), tmp_path, ONE)
    assert retry.step == 4
    nan_at(retry.model, set(range(3, 100)))  # steps 5, 6 good; 7, 8, 9 fail
    assert retry.run() == 1
    names = [p.name for p in complete_checkpoints(root)]
    assert names == ["step_00000006", "step_00000004"]  # keep=1, but step 4 is protected
    assert (root / "step_00000006" / PROTECTED).is_file()


def test_scheduled_saves_wait_while_steps_are_being_skipped(dataset, tmp_path):
    training = build_training(config(dataset, 4), tmp_path, ONE)
    nan_at(training.model, {2, 3})  # steps 2 and 3 skipped: no checkpoint at step 2
    assert training.run() == 0
    names = {p.name for p in complete_checkpoints(tmp_path / "checkpoints")}
    assert "step_00000002" not in names and "step_00000004" in names


def test_skipped_steps_say_whether_the_loss_or_the_gradient_was_not_finite(dataset, tmp_path):
    training = build_training(small_config(dataset, max_steps=4), tmp_path, ONE)
    nan_at(training.model, {2})
    param = training.model.embed.weight
    calls = {"n": 0}

    def infinite_on_step_4(grad: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        return grad * math.inf if calls["n"] == 4 else grad

    param.register_hook(infinite_on_step_4)
    assert training.run() == 0
    rows = {r["step"]: r for r in metric_rows(tmp_path) if "loss" in r}
    assert rows[2]["skipped/nonfinite_loss"] == 1 and rows[2]["skipped_loss"] == "nan"
    assert rows[4]["skipped/nonfinite_grad_norm"] == 1
    assert isinstance(rows[4]["skipped_loss"], float) and math.isfinite(rows[4]["skipped_loss"])
    assert "skipped/nonfinite_loss" not in rows[4] and not any("skipped/" in k for k in rows[1])


def test_a_run_ending_in_a_streak_keeps_the_last_good_and_its_finite_weights(
    dataset, tmp_path, caplog
):
    """Steps 5-6 (the last) are skipped: the checkpoint from before them (step 4) is protected
    as a streak stop protects it, and the weights, finite and unchanged since step 4, are saved
    as step 6 (keep=1 would otherwise delete step 4); nothing of the run's work is lost."""
    caplog.set_level("INFO")
    training = build_training(config(dataset, 6), tmp_path, ONE)
    nan_at(training.model, {5, 6})
    assert training.run() == 0
    root = tmp_path / "checkpoints"
    assert [p.name for p in complete_checkpoints(root)] == ["step_00000006", "step_00000004"]
    assert (root / "step_00000004" / PROTECTED).is_file()
    assert "training ended with 2 skipped step(s) in a row (from step 5)" in caplog.text
    assert "end of training, after 2 skipped step(s)" in caplog.text


def test_nonfinite_weights_are_never_saved_evaluated_or_sampled(dataset, tmp_path, caplog):
    training = build_training(config(dataset, 2), tmp_path, ONE)
    assert training.run() == 0
    resumed = build_training(config(dataset, 4), tmp_path, ONE)
    resumed.step = 3  # as if a step had made the weights overflow
    with torch.no_grad():
        resumed.engine.state_module.norm.weight[0] = math.nan
    assert resumed.save("a test") is False
    root = tmp_path / "checkpoints"
    assert [p.name for p in complete_checkpoints(root)] == ["step_00000002"]
    assert (root / "step_00000002" / PROTECTED).is_file()
    assert "not saving a checkpoint at step 3 (a test): 1 of" in caplog.text
    assert "weight tensors hold NaN or inf (norm.weight)" in caplog.text
    assert resumed._evaluate() is True
    assert "evaluation and sample at step 3 skipped" in caplog.text
    assert not [r for r in metric_rows(tmp_path) if r.get("step") == 3]
    # a stop signal saves nothing either; the run ends with the last good checkpoint named
    resumed.stop.received = signal.SIGTERM
    assert resumed.run() == resumed.stop.exit_code()
    assert "not saving a checkpoint at step 3 (SIGTERM received)" in caplog.text
    assert [p.name for p in complete_checkpoints(root)] == ["step_00000002"]
