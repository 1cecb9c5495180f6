"""The trainer's training engine for the `tiny` preset in one CPU process, as the benches build
it (the same call `python -m trainer` makes, without a run directory)."""

from __future__ import annotations

import torch

from model.presets import load_preset
from optim.config import OptimConfig
from parallel.config import ParallelConfig
from parallel.engine import TrainingEngine
from parallel.mesh import ParallelDims
from trainer.build import build_training_engine
from trainer.config import TrainerConfig


def tiny_cpu_engine(precision: str = "bf16", compile: bool = False) -> TrainingEngine:
    """The tiny preset's engine (AdamW, `trainer.precision`, `trainer.compile`), weights drawn
    from seed 0."""
    torch.manual_seed(0)
    dims = ParallelDims.resolve(ParallelConfig(), 1)
    tcfg = TrainerConfig(precision=precision, compile=compile)
    return build_training_engine(
        load_preset("tiny"), tcfg, ParallelConfig(), OptimConfig(), dims, torch.device("cpu"), 0
    )
