"""Pipeline parallelism's plan: the schedule, the stages and which rank runs each (the split
itself is model/stages.py's `pipeline_layouts`, which the planner reads too).

The stack is split into contiguous stages. By default each block weighs its training FLOPs per
token (model/accounting.py: its matmuls, plus its mixer's attention over the sequence), the last
stage also the head's (once per MTP depth more, with the MTP blocks), and the split minimises the
heaviest stage, so a hybrid stack of cheap linear-attention blocks and softmax ones is balanced
by work, not by count. `parallel.pp_layers` gives the blocks per stage explicitly instead.

Stages per rank: 1 for the single-stage schedules (GPipe, 1F1B), 2 for the multi-stage ones
(Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) unless
`parallel.pp_stages_per_rank` says otherwise. Stage s runs on pipeline rank s % pp ("loop"), or
for the V schedules on rank s for s < pp and 2 pp - 1 - s after ("v": the first and the last
stage share rank 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    get_schedule_class,
)

from model.config import ModelConfig
from model.errors import ConfigError
from model.stages import (
    MULTI_STAGE,
    SCHEDULES,
    SPLIT_BACKWARD,
    V_SCHEDULES,
    StageLayout,
    canonical_schedule,
    pipeline_layouts,
    stage_rank,
    stages_per_rank,
)

if TYPE_CHECKING:
    from parallel.config import ParallelConfig

__all__ = ["SCHEDULES", "SPLIT_BACKWARD", "PipelinePlan", "stages_per_rank"]


@dataclass(frozen=True)
class PipelinePlan:
    schedule: str  # one of SCHEDULES
    pp: int  # pipeline ranks
    stages: list[StageLayout]  # every stage, in order
    v_style: bool  # stages placed in a V (the first and last on rank 0)

    def rank_of(self, stage: int) -> int:
        """The pipeline rank that runs `stage`."""
        return stage_rank(stage, self.pp, self.v_style)

    def stages_of(self, pp_rank: int) -> list[StageLayout]:
        return [s for s in self.stages if self.rank_of(s.index) == pp_rank]

    def describe(self) -> str:
        lines = [f"pipeline: {self.schedule}, {len(self.stages)} stages on {self.pp} ranks"]
        for stage in self.stages:
            lines.append(f"  rank {self.rank_of(stage.index)}: {stage.describe()}")
        return "\n".join(lines)


def schedule_class(name: str) -> type:
    """The torch.distributed.pipelining schedule called `name` (case-insensitive)."""
    return get_schedule_class(canonical_schedule(name))


def plan_pipeline(
    model, seq_len: int, pp: int, schedule: str, per_rank: int, layers: list[int]
) -> PipelinePlan:
    """The pipeline of a whole model (built on the meta device) for `pp` ranks."""
    name = canonical_schedule(schedule)
    multi = issubclass(schedule_class(name), PipelineScheduleMulti)
    assert multi == (name in MULTI_STAGE), name  # model/stages.py's list agrees with torch's
    stages = pipeline_layouts(model, seq_len, pp, name, per_rank, layers)
    return PipelinePlan(name, pp, stages, v_style=name in V_SCHEDULES)


def check_pipeline_model(cfg: ModelConfig, parallel: ParallelConfig) -> None:
    """What a pipeline does not run with (yet), refused in one line at start-up."""
    schedule = canonical_schedule(parallel.pp_schedule)
    if schedule in SPLIT_BACKWARD and cfg.mtp.depth:
        # their weight pass computes each parameter group's gradients without keeping the
        # graph; MTP's path from the embedding copy (norm, projection) feeds several groups
        raise ConfigError(
            f"parallel.pp_schedule={schedule} splits the backward into input and weight "
            "passes, which torch.distributed.pipelining cannot do through the MTP modules' "
            "embedding path: with model.mtp.depth > 0 choose GPipe, 1F1B, Interleaved1F1B or "
            "LoopedBFS"
        )
    if parallel.sequence_parallel:
        raise ConfigError(
            "parallel.sequence_parallel=true with parallel.pp > 1 is not supported yet: set "
            "parallel.sequence_parallel=false"
        )
    if cfg.engram.enabled and cfg.engram.sharding == "replicated":
        raise ConfigError(
            "model.engram.sharding=replicated with parallel.pp > 1 is not supported yet: set "
            "model.engram.sharding=rows"
        )
