"""Pipeline parallelism's plan: the schedule, the stages and which rank runs each.

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

from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    get_schedule_class,
)

from model.accounting import matmul_params_per_token
from model.errors import ConfigError
from model.stages import StageLayout

V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
# the schedules that run a stage's backward as an input pass and a later weight pass
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
SCHEDULES = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)


@dataclass(frozen=True)
class PipelinePlan:
    schedule: str  # one of SCHEDULES
    pp: int  # pipeline ranks
    stages: list[StageLayout]  # every stage, in order
    v_style: bool  # stages placed in a V (the first and last on rank 0)

    def rank_of(self, stage: int) -> int:
        """The pipeline rank that runs `stage`."""
        if self.v_style and stage >= self.pp:
            return 2 * self.pp - 1 - stage
        return stage % self.pp

    def stages_of(self, pp_rank: int) -> list[StageLayout]:
        return [s for s in self.stages if self.rank_of(s.index) == pp_rank]

    def describe(self) -> str:
        lines = [f"pipeline: {self.schedule}, {len(self.stages)} stages on {self.pp} ranks"]
        for stage in self.stages:
            lines.append(f"  rank {self.rank_of(stage.index)}: {stage.describe()}")
        return "\n".join(lines)


def schedule_class(name: str) -> type:
    """The torch.distributed.pipelining schedule called `name` (case-insensitive)."""
    for known in SCHEDULES:
        if known.lower() == name.lower():
            return get_schedule_class(known)
    raise ConfigError(f"parallel.pp_schedule={name!r} is not one of {', '.join(SCHEDULES)}")


def canonical_schedule(name: str) -> str:
    schedule_class(name)
    return next(known for known in SCHEDULES if known.lower() == name.lower())


def stages_per_rank(schedule: str, requested: int) -> int:
    multi = issubclass(schedule_class(schedule), PipelineScheduleMulti)
    if requested == 0:
        return 2 if multi else 1
    if not multi and requested != 1:
        raise ConfigError(
            f"parallel.pp_schedule={schedule} runs one stage per rank; "
            f"parallel.pp_stages_per_rank={requested} needs a multi-stage schedule "
            "(Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV)"
        )
    if canonical_schedule(schedule) in V_SCHEDULES and requested != 2:
        raise ConfigError(
            f"parallel.pp_schedule={schedule} places two stages per rank in a V; "
            f"parallel.pp_stages_per_rank={requested} must be 2 (or 0)"
        )
    return requested


def layer_costs(model, seq_len: int) -> tuple[list[float], float]:
    """(each block's training FLOPs per token, the head's and MTP's) of a whole model (meta)."""
    costs = [
        2.0 * matmul_params_per_token(block) + block.attn.mixing_flops_per_token(seq_len)
        for block in model.layers.values()
    ]
    heads = 1 + (len(model.mtp.layers) if model.mtp is not None else 0)
    head = 2.0 * heads * model.head_weight.numel()
    if model.mtp is not None:
        head += sum(
            2.0 * matmul_params_per_token(m) + m.block.attn.mixing_flops_per_token(seq_len)
            for m in model.mtp.layers
        )
    return costs, head


def split_layers(costs: list[float], last_extra: float, stages: int) -> list[tuple[int, ...]]:
    """Contiguous blocks per stage minimising the heaviest stage (the last carries
    `last_extra` more); every stage gets at least one block when there are enough."""
    n = len(costs)
    if stages > n:
        raise ConfigError(
            f"{stages} pipeline stages for {n} layers: every stage needs a layer; lower "
            "parallel.pp or parallel.pp_stages_per_rank"
        )
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: the smallest heaviest stage splitting blocks [0, i) into s stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            extra = last_extra if s == stages else 0.0
            for j in range(s - 1, i):
                worst = max(best[s - 1][j], prefix[i] - prefix[j] + extra)
                if worst < best[s][i]:
                    best[s][i], cut[s][i] = worst, j
    bounds, i = [], n
    for s in range(stages, 0, -1):
        j = cut[s][i]
        bounds.append((j, i))
        i = j
    return [tuple(range(lo, hi)) for lo, hi in reversed(bounds)]


def explicit_layers(counts: list[int], n_layers: int, stages: int) -> list[tuple[int, ...]]:
    if len(counts) != stages or sum(counts) != n_layers or min(counts) < 0:
        raise ConfigError(
            f"parallel.pp_layers={counts} must list the layers of each of the {stages} stages "
            f"(pp x stages per rank), summing to model.n_layers={n_layers}"
        )
    out, start = [], 0
    for count in counts:
        out.append(tuple(range(start, start + count)))
        start += count
    return out


def plan_pipeline(
    model, seq_len: int, pp: int, schedule: str, per_rank: int, layers: list[int]
) -> PipelinePlan:
    """The pipeline of a whole model (built on the meta device) for `pp` ranks."""
    name = canonical_schedule(schedule)
    count = pp * stages_per_rank(name, per_rank)
    n_layers = len(model.layers)
    if layers:
        split = explicit_layers(list(layers), n_layers, count)
    else:
        costs, head = layer_costs(model, seq_len)
        split = split_layers(costs, head, count)
    stages = [StageLayout(i, count, blocks) for i, blocks in enumerate(split)]
    return PipelinePlan(name, pp, stages, v_style=name in V_SCHEDULES)
