"""Optimizer and learning-rate schedule settings (the `optim` config group)."""

from __future__ import annotations

from dataclasses import dataclass, field

from optim.bounds import BELOW_ONE, NON_NEGATIVE, POSITIVE, UNIT, Bounds, broken_rule
from optim.errors import OptimConfigError
from optim.matrix_blocks import SCALINGS, SPLIT_MODES
from optim.newton_schulz import SCHEDULES as NS_TABLES

OPTIMIZERS = ("adamw", "muon", "muonclip")  # the builder's registry keys (optim.builder.BUILDERS)
SCHEDULES = ("cosine", "wsd", "constant")
NS_SCHEDULES = tuple(NS_TABLES)  # optim.newton_schulz
MUON_SCALINGS = SCALINGS  # optim.matrix_blocks.update_scale
MUON_SPLITS = SPLIT_MODES  # optim.matrix_blocks
DECAY_SHAPES = ("linear", "cosine", "sqrt")
CHOICES = {  # field -> the values it may take
    "name": OPTIMIZERS,
    "schedule": SCHEDULES,
    "decay_shape": DECAY_SHAPES,
    "ns_schedule": NS_SCHEDULES,
    "muon_scaling": MUON_SCALINGS,
    "muon_split": MUON_SPLITS,
}
NUMBER_RULES = {  # every numeric field -> its rule (finite, in the interval)
    "lr": POSITIVE,
    "beta1": BELOW_ONE,
    "beta2": BELOW_ONE,
    "eps": POSITIVE,
    "weight_decay": NON_NEGATIVE,
    "warmup_steps": NON_NEGATIVE,
    "min_lr_ratio": UNIT,
    "decay_fraction": Bounds(0, 1, low_open=True),
    "muon_momentum": BELOW_ONE,
    "muon_momentum_warmup": Bounds(0, note="0 = off"),
    "muon_momentum_start": BELOW_ONE,
    "ns_steps": Bounds(1, 20),
    "adamw_lr": Bounds(0, note="0 = optim.lr"),
    "qk_clip_tau": Bounds(0, note="0 = off"),
    "memory_lr_multiplier": POSITIVE,
}


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise OptimConfigError(message)


@dataclass(kw_only=True)
class OptimConfig:
    name: str = "adamw"  # optimizer (the builder's registry key)
    lr: float = 3e-3  # peak learning rate
    beta1: float = 0.9  # AdamW's first-moment decay (also the AdamW groups under Muon)
    beta2: float = 0.95  # AdamW's second-moment decay
    eps: float = 1e-8  # AdamW's denominator epsilon
    # decoupled; on matrices, expert stacks, embeddings and routers (not norms, biases, gains,
    # convs, mixing or decay parameters, nor Engram tables: optim/roles.py)
    weight_decay: float = 0.1
    schedule: str = "cosine"  # cosine | wsd (warmup-stable-decay) | constant (after warmup)
    warmup_steps: int = 50  # linear warmup from 0 to lr
    min_lr_ratio: float = 0.1  # final lr = lr * min_lr_ratio (cosine and wsd)
    decay_fraction: float = 0.2  # wsd: the last fraction of steps that decay to the final lr
    decay_shape: str = "sqrt"  # wsd decay: linear | cosine | sqrt (1 - sqrt, as in MiniCPM)
    # Muon (optim=muon): hidden matrices; the rest (embeddings, head, norms, router) use AdamW
    muon_momentum: float = 0.95  # momentum of the Muon groups (Nesterov by muon_nesterov)
    muon_nesterov: bool = True  # Nesterov momentum in the Muon groups
    muon_momentum_warmup: int = 0  # steps ramping momentum from muon_momentum_start; 0 = off
    muon_momentum_start: float = 0.85  # momentum at step 0 of muon_momentum_warmup
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

    def describe(self) -> str:
        """One line for the start-up log: the optimizer, its peak lr and the schedule."""
        shape = (
            f", {self.decay_shape} decay over the last {self.decay_fraction:g}"
            if (self.schedule == "wsd")
            else ""
        )
        text = (
            f"{self.name}, lr {self.lr:g}, weight decay {self.weight_decay:g}; {self.schedule} "
            f"schedule after {self.warmup_steps} warmup steps{shape}"
        )
        if self.name in ("muon", "muonclip"):
            text += f"; Newton-Schulz {self.ns_schedule} x {self.ns_steps}"
        if self.qk_clip_tau > 0:
            text += f"; QK-clip at tau {self.qk_clip_tau:g}"
        return text

    def __post_init__(self) -> None:
        for key, choices in CHOICES.items():
            value = getattr(self, key)
            _require(value in choices, f"optim.{key}={value!r} is not one of: {', '.join(choices)}")
        broken = broken_rule("optim", self, NUMBER_RULES)
        _require(broken is None, str(broken))
        for key in ("lr", "adamw_lr"):  # decoupled decay: W <- W (1 - lr wd) every step
            lr = getattr(self, key)
            _require(
                lr * self.weight_decay < 1,
                f"optim.weight_decay={self.weight_decay} with optim.{key}={lr} multiplies the "
                f"weights by 1 - lr x weight_decay = {1 - lr * self.weight_decay:g} every step: "
                "lower optim.weight_decay so that lr x weight_decay < 1",
            )
