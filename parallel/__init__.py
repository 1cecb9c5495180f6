"""Device mesh, FSDP2, expert parallelism, activation checkpointing, compile, and the engines.

A plain `model.Transformer` built on the meta device is rewritten from outside, in a fixed order
(expert parallelism -> activation checkpointing -> compile per block -> FSDP2), then allocated
and filled (`parallel.compose`). The trainer sees only the resulting `TrainingEngine`
(`parallel.engine`), chosen by `parallel.engine` from the `ENGINES` registry.
"""

from __future__ import annotations

# Importing the engines registers them (fsdp2 in compose; deepspeed imports DeepSpeed on use only)
from parallel import compose  # noqa: F401
from parallel.compose import fsdp_param_dtype, parallelize
from parallel.deepspeed import engine as deepspeed_engine  # noqa: F401
from parallel.engine import ENGINES, EngineRequest, TrainingEngine, build_engine

__all__ = [
    "ENGINES",
    "EngineRequest",
    "TrainingEngine",
    "build_engine",
    "fsdp_param_dtype",
    "parallelize",
]
