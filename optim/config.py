"""Optimizer and learning-rate schedule settings (the `optim` config group)."""

from __future__ import annotations

from dataclasses import dataclass

from optim.errors import OptimConfigError

SCHEDULES = ("cosine", "wsd", "constant")
DECAY_SHAPES = ("linear", "cosine", "sqrt")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise OptimConfigError(message)


@dataclass(kw_only=True)
class OptimConfig:
    name: str = "adamw"  # optimizer (the builder's registry key)
    lr: float = 3e-3  # peak learning rate
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # decoupled; applied to matrices only (not norms, biases, gains)
    schedule: str = "cosine"  # cosine | wsd (warmup-stable-decay) | constant (after warmup)
    warmup_steps: int = 50  # linear warmup from 0 to lr
    min_lr_ratio: float = 0.1  # final lr = lr * min_lr_ratio (cosine and wsd)
    decay_fraction: float = 0.2  # wsd: the last fraction of steps that decay to the final lr
    decay_shape: str = "sqrt"  # wsd decay: linear | cosine | sqrt (1 - sqrt, as in MiniCPM)

    def __post_init__(self) -> None:
        _require(self.lr > 0, f"optim.lr={self.lr} must be > 0")
        _require(
            0 <= self.beta1 < 1 and 0 <= self.beta2 < 1,
            f"optim.beta1={self.beta1} and optim.beta2={self.beta2} must be in [0, 1)",
        )
        _require(self.eps > 0, f"optim.eps={self.eps} must be > 0")
        _require(self.weight_decay >= 0, f"optim.weight_decay={self.weight_decay} must be >= 0")
        _require(
            self.schedule in SCHEDULES,
            f"optim.schedule={self.schedule!r} is not one of {SCHEDULES}",
        )
        _require(
            self.decay_shape in DECAY_SHAPES,
            f"optim.decay_shape={self.decay_shape!r} is not one of {DECAY_SHAPES}",
        )
        _require(self.warmup_steps >= 0, f"optim.warmup_steps={self.warmup_steps} must be >= 0")
        _require(
            0 <= self.min_lr_ratio <= 1, f"optim.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]"
        )
        _require(
            0 < self.decay_fraction <= 1,
            f"optim.decay_fraction={self.decay_fraction} must be in (0, 1]",
        )
