"""One optimizer step: gradient accumulation over micro-batches, clipping, and the skip rule.

A step whose loss or gradient norm is not finite (or whose loss spikes above `spike_factor` x
the running mean of recent good losses) makes no update: the gradients are dropped and the
caller counts it. The check costs one host sync per step (the loss and norm are needed on the
host to log them anyway).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist

from data.loader import Batch
from model.training_hooks import TrainingHook, UpdatedWeights, objective_with, stage_combines
from parallel.collective import several_ranks
from parallel.engine import TrainingEngine

EMA_DECAY = 0.98  # running mean of good losses for the spike rule (about 50 steps)


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    skipped: str  # "" when the update was applied, else why not (one line for the log)
    # the training hooks' metrics (moe/..., mtp/..., qk/..., attnres/...: model.training_hooks)
    metrics: dict[str, float] = field(default_factory=dict)
    skip_kind: str = ""  # nonfinite_loss | nonfinite_grad_norm | loss_spike (metrics keys)


class LossTracker:
    """Running mean of applied-step losses; judges spikes once it has seen a few steps."""

    def __init__(self, spike_factor: float):
        self.factor, self.mean, self.seen = spike_factor, 0.0, 0

    def spike(self, loss: float) -> bool:
        return self.factor > 0 and self.seen >= 20 and loss > self.factor * self.mean

    def update(self, loss: float) -> None:
        self.seen += 1
        self.mean = loss if self.seen == 1 else EMA_DECAY * self.mean + (1 - EMA_DECAY) * loss

    def state_dict(self) -> dict:
        return {"mean": self.mean, "seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.seen = float(state["mean"]), int(state["seen"])


@dataclass(frozen=True)
class StepSettings:
    """How every step of a run is taken (trainer.*)."""

    micro_batches: int = 1  # gradient accumulation: micro-batches per step on this rank
    grad_clip: float = 0.0  # global gradient-norm clip; 0 = off (the norm is still measured)
    doc_mask: bool = False  # attention stays inside documents (the loader's document ids)


def train_step(
    engine: TrainingEngine,
    batch: Batch,
    settings: StepSettings,
    tracker: LossTracker,
    hooks: Sequence[TrainingHook],
) -> StepResult:
    """One optimizer step over this rank's slice of the global batch.

    Several ranks: the engine reduces gradients across them, the norm is global over all
    shards, and the loss is averaged over ranks, so every rank takes the same skip decision.
    The model's features take part through `hooks` (model.training_hooks): their objective
    terms join each micro-batch's loss, their statistics are reduced over the ranks after the
    backward, they may edit the updated weights, and they contribute the step's metrics.
    """
    n = settings.micro_batches
    objective = objective_with(hooks)
    doc_ids = batch.doc_ids if settings.doc_mask else None
    loss_sum = engine.forward_backward_step(batch.inputs, batch.targets, doc_ids, n, objective)
    max_norm = settings.grad_clip if settings.grad_clip > 0 else float("inf")
    loss_value = _mean_over_ranks(loss_sum / n)
    kind, reason = _bad_loss_reason(loss_value, tracker)
    stats: dict[str, float] = {}
    reduce = partial(
        _reduce_over_ranks, together=engine.ranks_per_forward, group=engine.statistics_group
    )
    for hook in hooks:  # after the loss's sync: reading the small summaries costs nothing
        stats |= hook.after_backward(reduce)

    def edit(weights: UpdatedWeights) -> None:
        for hook in hooks:
            stats.update(hook.after_update(weights))

    norm_value, applied = engine.finish_step(max_norm, not reason, edit if hooks else None)
    if not reason and not applied:
        kind = "nonfinite_grad_norm"
        reason = f"gradient norm is {norm_value} (loss {loss_value:.4f})"
    if applied:
        tracker.update(loss_value)
    for hook in hooks:
        hook.end_step(applied)
    engine.zero_grad()
    stats = engine.gather_metrics(stats, stage_combines(hooks))
    return StepResult(loss_value, norm_value, reason, stats, kind)


def _bad_loss_reason(loss: float, tracker: LossTracker) -> tuple[str, str]:
    """(kind, reason) of a step whose loss says it must not be applied; ("", "") for a good
    one. A good loss can still come with a non-finite gradient norm (judged by the engine)."""
    if not math.isfinite(loss):
        return "nonfinite_loss", f"loss is {loss}"
    if tracker.spike(loss):
        return "loss_spike", f"loss {loss:.3f} > {tracker.factor} x running mean {tracker.mean:.3f}"
    return "", ""


def _mean_over_ranks(value: torch.Tensor) -> float:
    if several_ranks():  # SUM then divide: gloo has no AVG
        value = value.clone()
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value.item()


def _reduce_over_ranks(value: torch.Tensor, op: str, together: int = 1, group=None) -> None:
    """The hooks' reduction over the data-parallel ranks: `value` summed ("sum") or maximized
    ("max"). `together` ranks run each forward (tensor parallelism) and hold the same
    statistics, so a sum over every rank counts them `together` times. `group`: the ranks
    holding the same layers (a pipeline's stage; None: every rank)."""
    if several_ranks():
        op_ = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        dist.all_reduce(value, op=op_, group=group)
        if op == "sum" and together > 1:
            value /= together
