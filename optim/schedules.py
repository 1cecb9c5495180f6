"""Learning-rate schedules as pure functions of the step (nothing to checkpoint but the step).

`Schedule` is what the trainer's loop calls once per step: it sets every param group's lr (each
group's own peak `base_lr` times the multiplier) and the Muon groups' momentum.

All start with a linear warmup from 0 (step 0 gets lr/warmup, so no step is wasted at lr=0):
- cosine: from lr down to lr * min_lr_ratio at `total_steps`;
- wsd: warmup, constant lr, then over the last `decay_fraction` of the steps a decay to
  lr * min_lr_ratio with shape linear, cosine or sqrt (1 - sqrt(progress), MiniCPM's choice);
- constant: lr after warmup.
"""

from __future__ import annotations

import math

import torch

from optim.config import OptimConfig


def _decay(progress: float, shape: str) -> float:
    """Fraction of the way from the peak (1) to the floor (0) still left, progress in [0, 1]."""
    progress = min(max(progress, 0.0), 1.0)
    if shape == "linear":
        return 1.0 - progress
    if shape == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0 - math.sqrt(progress)


def lr_multiplier(cfg: OptimConfig, step: int, total_steps: int) -> float:
    """lr(step) / cfg.lr for the step about to be taken (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    floor = cfg.min_lr_ratio
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "cosine":
        span = max(1, total_steps - cfg.warmup_steps)
        left = _decay((step - cfg.warmup_steps) / span, "cosine")
        return floor + (1.0 - floor) * left
    decay_steps = max(1, round(cfg.decay_fraction * total_steps))
    decay_start = total_steps - decay_steps
    if step < decay_start:
        return 1.0
    left = _decay((step - decay_start) / decay_steps, cfg.decay_shape)
    return floor + (1.0 - floor) * left


def muon_momentum(cfg: OptimConfig, step: int) -> float:
    """Muon's momentum for the step about to be taken: optionally ramped linearly from
    `muon_momentum_start` to `muon_momentum` over `muon_momentum_warmup` steps."""
    if step >= cfg.muon_momentum_warmup:
        return cfg.muon_momentum
    frac = step / cfg.muon_momentum_warmup
    return cfg.muon_momentum_start + frac * (cfg.muon_momentum - cfg.muon_momentum_start)


class Schedule:
    """The learning-rate and Muon-momentum schedules of one run (`max_steps` long)."""

    def __init__(self, cfg: OptimConfig, total_steps: int) -> None:
        self.cfg, self.total_steps = cfg, total_steps

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        """Set the groups for the step about to be taken (0-based); returns the logged lr."""
        multiplier = lr_multiplier(self.cfg, step, self.total_steps)
        momentum = muon_momentum(self.cfg, step)
        for group in optimizer.param_groups:  # groups may have their own peak lr
            group["lr"] = group.get("base_lr", self.cfg.lr) * multiplier
            if group.get("algorithm") == "muon":
                group["momentum"] = momentum
        return self.cfg.lr * multiplier
