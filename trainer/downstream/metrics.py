"""The library's metrics (olmo_eval.metrics.ICLMetric) from continuation log-likelihoods.

ICLMetric reads a continuation's log-likelihood as `-cross_entropy(logits, continuation)` summed
over the continuation's positions. It gets each request as a single position over a two-word
vocabulary whose word 0 (the continuation) has logit `s`, the summed log-probability, and word 1
`log(1 - e^s)`: the cross-entropy is then exactly `-s`. So accuracy, length-normalised accuracy,
PMI, F1, bits per byte and the soft scores are the library's own formulas (with its v2 lengths,
OLMES's: the continuation's leading space counted), without ever forming (B, T, V) logits.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from trainer.downstream.tasks import LENGTH_KEYS, MULTIPLE_CHOICE, DownstreamTask

SECONDARY = ("acc", "len_norm")  # reported for every multiple-choice task beside its own type


def task_metrics(task: DownstreamTask, sums: Tensor, dc_sums: Tensor | None) -> dict[str, float]:
    """{metric: value} for one task: every value of its primary metric type (e.g. len_norm,
    ce_loss, bpb, soft, soft_log), then acc and len_norm for multiple choice; `sums` (len(task.requests),)
    and, for pmi_dc tasks, `dc_sums` the same continuations' domain-conditional ones."""
    from olmo_eval.metrics import ICLMetric

    types = [task.metric_type]
    if task.metric_type in MULTIPLE_CHOICE:
        types += [t for t in SECONDARY if t != task.metric_type]
    batch = _batch(task)
    logits = _two_word_logits(sums)
    dc_logits = _two_word_logits(dc_sums) if dc_sums is not None else None
    results: dict[str, float] = {}
    for metric_type in types:
        metric = ICLMetric(metric_type)
        metric._to_sync = metric.sync_on_compute = False  # every rank holds every sum already
        metric.update(batch, logits, dc_logits if metric_type == "pmi_dc" else None)
        with warnings.catch_warnings():  # its torch.tensor(tensor) copies
            warnings.simplefilter("ignore", UserWarning)
            values = metric.compute()
        for key, value in values.items():
            name = key.removesuffix("_v2")
            # v1: the leading space not counted (older OLMo numbers); a secondary type adds its
            # accuracy only (its soft scores are over other normalisations than the primary's)
            if key.endswith("_v2") and (metric_type == task.metric_type or name == metric_type):
                results[name] = float(value)
    return results


def _two_word_logits(sums: Tensor) -> Tensor:
    """(N, 1, 2): [s, log(1 - e^s)] per request (float64; s clamped to <= 0 against rounding)."""
    s = sums.double().clamp(max=0.0)
    return torch.stack([s, torch.log(-torch.expm1(s))], dim=-1)[:, None, :]


def _batch(task: DownstreamTask) -> dict[str, Any]:
    """The library's batch fields for `task`'s requests: each continuation one position long
    (the 'token' is word 0), read from position 0 (ctx_len = dc_len = 1)."""
    n = len(task.info)
    column = lambda key: torch.tensor([row[key] for row in task.info], dtype=torch.long)  # noqa: E731
    ones = torch.ones(n, dtype=torch.long)
    return {
        "doc_id": column("doc_id"),
        "cont_id": column("cont_id"),
        "label_id": column("label_id"),
        "continuation": torch.zeros(n, 1, dtype=torch.long),
        "cont_len": ones,
        "ctx_len": ones,
        "dc_len": ones,
        **{key: column(key) for key in LENGTH_KEYS},
    }
