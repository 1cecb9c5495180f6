"""Optimizer and learning-rate schedule settings (the `optim` config group)."""

from __future__ import annotations

from dataclasses import dataclass, field

from optim.errors import OptimConfigError
from optim.matrix_blocks import SCALINGS, SPLIT_MODES
from optim.newton_schulz import SCHEDULES as NS_TABLES

OPTIMIZERS = ("adamw", "muon", "muonclip")  # the builder's registry keys (optim.builder.BUILDERS)
SCHEDULES = ("cosine", "wsd", "constant")
NS_SCHEDULES = tuple(NS_TABLES)  # optim.newton_schulz
MUON_SCALINGS = SCALINGS  # optim.matrix_blocks.update_scale
MUON_SPLITS = SPLIT_MODES  # optim.matrix_blocks
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
    # Muon (optim=muon): hidden matrices; the rest (embeddings, head, norms, router) use AdamW
    muon_momentum: float = 0.95  # momentum of the Muon groups (Nesterov by muon_nesterov)
    muon_nesterov: bool = True
    muon_momentum_warmup: int = 0  # steps ramping momentum from muon_momentum_start; 0 = off
    muon_momentum_start: float = 0.85
    ns_steps: int = 5  # Newton-Schulz iterations
    ns_schedule: str = "quintic"  # quintic (3.4445, -4.7750, 2.0315) | polar_express
    muon_scaling: str = "match_adamw"  # match_adamw (0.2 sqrt(max dim)) | spectral
    adamw_lr: float = 0.0  # peak lr of the AdamW-group parameters under Muon; 0 = optim.lr
    muon_exclude: list[str] = field(default_factory=list)  # name patterns kept on AdamW
    # matrices Muon orthogonalizes: none (weights whole) | fused (split fused projections such
    # as MLA's kv_a/kv_b into their parts) | heads (also every attention head's slice alone)
    muon_split: str = "fused"
    qk_clip_tau: float = 0.0  # MuonClip: cap each head's max attention logit at this; 0 = off
    # Engram's tables (role memory): row-wise Adam at this x the AdamW learning rate, no decay
    memory_lr_multiplier: float = 5.0

    def __post_init__(self) -> None:
        _require(
            self.name in OPTIMIZERS,
            f"optim.name={self.name!r} is not available; choose one of: {', '.join(OPTIMIZERS)}",
        )
        _require(self.lr > 0, f"optim.lr={self.lr} must be > 0")
        _require(
            0 <= self.beta1 < 1 and 0 <= self.beta2 < 1,
            f"optim.beta1={self.beta1} and optim.beta2={self.beta2} must be in [0, 1)",
        )
        _require(self.eps > 0, f"optim.eps={self.eps} must be > 0")
        _require(
            self.memory_lr_multiplier > 0,
            f"optim.memory_lr_multiplier={self.memory_lr_multiplier} must be > 0",
        )
        _require(self.weight_decay >= 0, f"optim.weight_decay={self.weight_decay} must be >= 0")
        _require(
            self.schedule in SCHEDULES,
            f"optim.schedule={self.schedule!r} is not one of {SCHEDULES}",
        )
        _require(
            self.decay_shape in DECAY_SHAPES,
            f"optim.decay_shape={self.decay_shape!r} is not one of {DECAY_SHAPES}",
        )
        _require(
            self.ns_schedule in NS_SCHEDULES,
            f"optim.ns_schedule={self.ns_schedule!r} is not one of {NS_SCHEDULES}",
        )
        _require(
            self.muon_scaling in MUON_SCALINGS,
            f"optim.muon_scaling={self.muon_scaling!r} is not one of {MUON_SCALINGS}",
        )
        _require(
            self.muon_split in MUON_SPLITS,
            f"optim.muon_split={self.muon_split!r} is not one of {MUON_SPLITS}",
        )
        _require(1 <= self.ns_steps <= 20, f"optim.ns_steps={self.ns_steps} must be in [1, 20]")
        _require(
            0 <= self.muon_momentum < 1,
            f"optim.muon_momentum={self.muon_momentum} must be in [0, 1)",
        )
        _require(
            self.muon_momentum_warmup >= 0 and 0 <= self.muon_momentum_start < 1,
            f"optim.muon_momentum_warmup={self.muon_momentum_warmup} must be >= 0 and "
            f"optim.muon_momentum_start={self.muon_momentum_start} in [0, 1)",
        )
        _require(self.adamw_lr >= 0, f"optim.adamw_lr={self.adamw_lr} must be >= 0 (0 = optim.lr)")
        _require(
            self.qk_clip_tau >= 0, f"optim.qk_clip_tau={self.qk_clip_tau} must be >= 0 (0 = off)"
        )
        _require(self.warmup_steps >= 0, f"optim.warmup_steps={self.warmup_steps} must be >= 0")
        _require(
            0 <= self.min_lr_ratio <= 1, f"optim.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]"
        )
        _require(
            0 < self.decay_fraction <= 1,
            f"optim.decay_fraction={self.decay_fraction} must be in (0, 1]",
        )
