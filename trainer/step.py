"""One optimizer step: gradient accumulation over micro-batches, clipping, and the skip rule.

A step whose loss or gradient norm is not finite (or whose loss spikes above `spike_factor` x
the running mean of recent good losses) makes no update: the gradients are dropped and the
caller counts it. The check costs one host sync per step (the loss and norm are needed on the
host to log them anyway).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from data.loader import Batch
from model.moe import apply_bias_update, expert_load, moe_stats, reset_moe_stats
from optim.qk_clip import RowScaler, apply_qk_clip, pop_max_logits, scale_rows
from parallel.collective import several_ranks
from parallel.engine import TrainingEngine

EMA_DECAY = 0.98  # running mean of good losses for the spike rule (about 50 steps)


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    skipped: str  # "" when the update was applied, else why not (one line for the log)
    moe: dict[str, float] = field(default_factory=dict)  # MoE (moe/...) and QK-clip (qk/...) stats
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


def split_micro_batches(batch: Batch, count: int) -> list[Batch]:
    if count == 1:
        return [batch]
    parts = [t.chunk(count) for t in batch]
    return [Batch(*fields) for fields in zip(*parts)]


@dataclass(frozen=True)
class StepSettings:
    """How every step of a run is taken (trainer.* and optim.qk_clip_tau)."""

    micro_batches: int = 1  # gradient accumulation: micro-batches per step on this rank
    grad_clip: float = 0.0  # global gradient-norm clip; 0 = off (the norm is still measured)
    doc_mask: bool = False  # attention stays inside documents (the loader's document ids)
    qk_clip_tau: float = 0.0  # MuonClip's cap on every head's max logit; 0 = off


def train_step(
    engine: TrainingEngine, batch: Batch, settings: StepSettings, tracker: LossTracker
) -> StepResult:
    """One optimizer step over this rank's slice of the global batch.

    Several ranks: the engine reduces gradients across them, the norm is global over all
    shards, and the loss is averaged over ranks, so every rank takes the same skip decision. MoE
    models add their balancing losses to each micro-batch's loss (in the engine) and update the
    aux-loss-free expert biases from the step's expert loads summed over ranks.
    """
    n = settings.micro_batches
    model = engine.model
    loss_sum = torch.zeros((), device=batch.inputs.device)
    for index, mb in enumerate(split_micro_batches(batch, n)):
        doc_ids = mb.doc_ids if settings.doc_mask else None
        loss_sum += engine.forward_backward(mb.inputs, mb.targets, doc_ids, n, index == n - 1)
    max_norm = settings.grad_clip if settings.grad_clip > 0 else float("inf")
    loss_value = _mean_over_ranks(loss_sum / n)
    kind, reason = _bad_loss_reason(loss_value, tracker)
    stats: dict[str, float] = {}
    stream = getattr(model, "stream", None)
    if stream is not None:  # after the loss's sync: reading the small summaries costs nothing
        stats |= stream.stats(model)  # e.g. Attention Residuals' depth weights (attnres/...)
    mtp = getattr(model, "mtp", None)
    if mtp is not None:
        stats |= mtp.stats(_sum_over_ranks)  # mtp/loss_<k>, mtp/weight
    tau = settings.qk_clip_tau
    scale = getattr(engine, "scale_rows", scale_rows)  # engines whose weights live elsewhere
    clip = (lambda masters: stats.update(_qk_clip(model, masters, tau, scale))) if tau > 0 else None
    norm_value, applied = engine.finish_step(max_norm, not reason, clip)
    if not reason and not applied:
        kind = "nonfinite_grad_norm"
        reason = f"gradient norm is {norm_value} (loss {loss_value:.4f})"
    if applied:
        tracker.update(loss_value)
    elif tau > 0:
        pop_max_logits(model)  # a skipped step's logits are not acted on
    stats |= _update_expert_biases(model, apply=not reason)
    engine.zero_grad()
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


def _sum_over_ranks(value: torch.Tensor) -> None:
    if several_ranks():
        dist.all_reduce(value)


def _qk_clip(
    model: nn.Module, updated: nn.Module, tau: float, scale: RowScaler = scale_rows
) -> dict[str, float]:
    """MuonClip: the step's per-head max logits (MAX over ranks) cap the updated weights."""
    logits = pop_max_logits(model)
    if logits is None:
        return {}
    if several_ranks():
        dist.all_reduce(logits, op=dist.ReduceOp.MAX)
    return apply_qk_clip(updated, logits, tau, scale)


def _update_expert_biases(model: nn.Module, apply: bool) -> dict[str, float]:
    """Aux-loss-free balancing: expert loads of the whole step (all micro-batches, all ranks),
    one all-reduce, the same bias update on every rank (a skipped step only clears the counts).
    Returns the step's MoE statistics for logging ({} for a dense model)."""
    load = expert_load(model)
    if load.numel() == 0:  # a dense model
        return {}
    if several_ranks():
        dist.all_reduce(load)
    stats = moe_stats(model, load)
    if apply:
        apply_bias_update(model, load)
    reset_moe_stats(model)
    return stats
