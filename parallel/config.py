"""Parallelism settings (`parallel.*`): mesh sizes, activation checkpointing, FSDP2 policy."""

from __future__ import annotations

from dataclasses import dataclass

from model.errors import ConfigError

AC_MODES = ("none", "full", "selective")
PARAM_DTYPES = ("auto", "bf16", "fp32")
BACKENDS = ("auto", "nccl", "gloo")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass(kw_only=True)
class ParallelConfig:
    dp_shard: int = -1  # ranks that shard dense weights (FSDP2); -1 = all that remain
    dp_replicate: int = 1  # replicas of the sharded group (HSDP when both > 1)
    ep: int = 1  # expert-parallel ranks, taken from dp_shard (experts split over them)
    activation_checkpoint: str = "none"  # none | full (recompute each block) | selective
    reshard_after_forward: bool = True  # FSDP2: free gathered weights after forward (ZeRO-3)
    param_dtype: str = "auto"  # FSDP2 gather/compute dtype: auto (bf16 unless precision=fp32)
    backend: str = "auto"  # process group backend: auto (nccl with CUDA, else gloo) | nccl | gloo
    # seconds a collective may wait for the other ranks before this rank gives up (a hung or
    # dead rank); raise it when ranks legitimately drift apart longer (long compiles or saves)
    timeout_s: float = 300.0
    # the training engine (parallel.engine.ENGINES): fsdp2 = one process or FSDP2/HSDP (+ EP)
    engine: str = "fsdp2"

    def __post_init__(self) -> None:
        _require(
            self.dp_shard == -1 or self.dp_shard >= 1,
            f"parallel.dp_shard={self.dp_shard} must be >= 1, or -1 for all remaining ranks",
        )
        for key in ("dp_replicate", "ep"):
            value = getattr(self, key)
            _require(value >= 1, f"parallel.{key}={value} must be >= 1")
        _require(
            self.activation_checkpoint in AC_MODES,
            f"parallel.activation_checkpoint={self.activation_checkpoint!r} is not one of {AC_MODES}",
        )
        _require(
            self.param_dtype in PARAM_DTYPES,
            f"parallel.param_dtype={self.param_dtype!r} is not one of {PARAM_DTYPES}",
        )
        _require(
            self.backend in BACKENDS, f"parallel.backend={self.backend!r} is not one of {BACKENDS}"
        )
        _require(self.timeout_s > 0, f"parallel.timeout_s={self.timeout_s} must be > 0")
