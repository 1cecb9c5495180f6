"""Downstream scoring's primitive on several ranks: each rank's per-token target log-probabilities
(TrainingEngine.evaluation_log_probs) under FSDP2 and under expert parallelism equal one process's
for the same rows (fp32, from the same seeded weights)."""

from __future__ import annotations

import pytest
import torch

from tests.parallel.ranks import run_ranks
from tests.parallel.workers import scored_log_probs, small_model

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
