"""The trainer's training engine for a preset in one CPU process, as the benches build it (the
same call `python -m trainer` makes, without a run directory), and its steps timed."""

from __future__ import annotations

import time

import torch

from model.presets import load_preset
from optim.config import OptimConfig
from parallel.config import ParallelConfig
from parallel.engine import TrainingEngine
from parallel.mesh import ParallelDims
from trainer.build import build_training_engine
from trainer.config import TrainerConfig


def cpu_engine(preset: str, precision: str = "bf16", compile: bool = False) -> TrainingEngine:
    """The preset's engine (AdamW, `trainer.precision`, `trainer.compile`), weights drawn from
    seed 0."""
    torch.manual_seed(0)
    dims = ParallelDims.resolve(ParallelConfig(), 1)
    tcfg = TrainerConfig(precision=precision, compile=compile)
    return build_training_engine(
        load_preset(preset), tcfg, ParallelConfig(), OptimConfig(), dims, torch.device("cpu"), 0
    )


def tiny_cpu_engine(precision: str = "bf16", compile: bool = False) -> TrainingEngine:
    """The tiny preset's engine (cpu_engine)."""
    return cpu_engine("tiny", precision, compile)


def time_train_steps(
    engine: TrainingEngine, vocab_size: int, steps: int, batch: int, seq_len: int
) -> list[float]:
    """Seconds of each of `steps` training steps (the trainer's train_step, gradient clipping
    at 1) on one random (batch, seq_len) batch of token ids below `vocab_size`."""
    from data.loader import Batch
    from trainer.hooks import start_hooks
    from trainer.step import LossTracker, StepSettings, train_step

    x = torch.randint(0, vocab_size, (batch, seq_len))
    tokens = Batch(x, torch.roll(x, -1, 1), torch.zeros_like(x, dtype=torch.int32))
    seconds, hooks = [], start_hooks(engine, 0.0, None)
    for _ in range(steps):
        start = time.perf_counter()
        train_step(engine, tokens, StepSettings(grad_clip=1.0), LossTracker(0.0), hooks)
        seconds.append(time.perf_counter() - start)
    return seconds
