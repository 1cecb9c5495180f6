"""The planner's pipeline parallelism (model/planner.py, `pp > 1`): each pipeline rank's plan.

Per pipeline rank, a copy of the meta model pruned to its stages (model/stages.py keep_stages)
goes through the per-rank accounting of model/planner.py, per step of m micro-batches (the
engine keeps FSDP2's gathered weights for the whole step: one all-gather and one reduce-scatter,
every gathered unit in transient memory; tensor, expert and context traffic m times). Then:
- activations: what each of its stages keeps per micro-batch (its blocks and the rest, and
  before the last stage the output it sent), for the micro-batches in flight
  (model/planner_activations.py `in_flight`, `pipeline_peak`);
- comm_pp: for each of its stages, m x the tensors crossing its end (forward) unless the next
  stage is on the same rank, m x those crossing its start (their gradients, backward) unless the
  previous one is; plus the shared embedding's fp32 gradient all-reduced between the first and
  the last stage's ranks (a tied head or MTP), unless one rank holds both (a V schedule: it keeps
  its own copy of the embedding instead, counted in its weights and gradients).
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace

from model.config import ConfigError, ModelConfig
from model.planner import (
    WIDTH,
    Layout,
    RankPlan,
    _activations,
    _rank_plan,
    _ring_all_reduce,
    check_layout,
    tensor_parallel_shares,
)
from model.planner_activations import in_flight, pipeline_peak
from model.stages import (
    SPLIT_BACKWARD,
    V_SCHEDULES,
    StageLayout,
    canonical_schedule,
    explicit_layers,
    keep_stages,
    pipeline_layouts,
    shares_embedding,
    stage_rank,
)
from model.transformer import Transformer


def check_pipeline(layout: Layout, cfg: ModelConfig) -> None:
    """The trainer's pipeline rules (model/stages.py, parallel/pipeline.py refuse_unsupported)
    and the schedules' own on the micro-batches (torch.distributed.pipelining)."""
    name = canonical_schedule(layout.pp_schedule)
    if layout.pp_layers:
        explicit_layers(list(layout.pp_layers), cfg.n_layers, layout.stages)
    m = layout.micro_batches
    rounds = max(1, m // layout.pp)
    if name in ("Interleaved1F1B", "InterleavedZeroBubble") and m % rounds:
        raise ConfigError(
            f"pp_microbatches={m}: {name} runs rounds of pp micro-batches; make it a multiple "
            f"of {rounds} (pp_microbatches // pp)"
        )
    if name == "DualPipeV" and m < layout.stages:
        raise ConfigError(
            f"pp_microbatches={m}: DualPipeV needs at least {layout.stages} (the stages)"
        )
    if name in SPLIT_BACKWARD and cfg.mtp.depth:
        raise ConfigError(
            f"pp_schedule={name} splits the backward, which cannot run through the MTP modules' "
            "embedding path: choose GPipe, 1F1B, Interleaved1F1B or LoopedBFS"
        )
    if layout.sequence_parallel:
        raise ConfigError("sequence_parallel=true with pp > 1 is not supported yet")
    if cfg.engram.enabled and cfg.engram.sharding == "replicated":
        raise ConfigError("model.engram.sharding=replicated with pp > 1 is not supported yet")


def pipeline_stages(model: Transformer, layout: Layout) -> list[StageLayout]:
    """Every pipeline stage of `model` (whole, meta) under `layout`, as the trainer splits it."""
    return pipeline_layouts(
        model,
        layout.seq_len,
        layout.pp,
        canonical_schedule(layout.pp_schedule),
        layout.pp_stages_per_rank,
        layout.pp_layers,
    )


def stage_ranks(layout: Layout, stages: list[StageLayout]) -> list[int]:
    """The pipeline rank of each stage (a V for ZBVZeroBubble and DualPipeV)."""
    v_style = canonical_schedule(layout.pp_schedule) in V_SCHEDULES
    return [stage_rank(s.index, layout.pp, v_style) for s in stages]


def pipeline_rank_plans(model: Transformer, layout: Layout) -> list[RankPlan]:
    """The plan of a rank of each pipeline rank (module docstring), per step of m micro-batches."""
    check_layout(layout, model.cfg)
    stages = pipeline_stages(model, layout)
    ranks = stage_ranks(layout, stages)
    m = layout.micro_batches
    step = replace(layout, reshard_after_forward=False)  # the engine keeps them for the step
    plans = []
    for rank in range(layout.pp):
        mine = [s for s, r in zip(stages, ranks, strict=True) if r == rank]
        held = _pruned(model, mine)
        plan = _rank_plan(held, step)
        activations = _pipeline_activations(model, step, stages, mine, held, rank)
        copy_ = _embedding_copy(model, layout, ranks)[rank]
        plans.append(
            replace(
                plan,
                weights=plan.weights + copy_,
                grads=plan.grads + copy_,
                activations=activations[0],
                activations_checkpointed=activations[1],
                recompute=activations[2],
                comm_tp=m * plan.comm_tp,
                comm_ep=m * plan.comm_ep,
                comm_cp=m * plan.comm_cp,
                comm_pp=_pipeline_comm(model, layout, stages, ranks, rank),
                pp_rank=rank,
            )
        )
    return plans


def _pipeline_activations(
    model: Transformer,
    layout: Layout,
    stages: list[StageLayout],
    mine: list[StageLayout],
    held: Transformer,
    rank: int,
) -> tuple[float, float, float]:
    """(no checkpointing, full checkpointing, one block's recompute) bytes pipeline rank `rank`
    keeps at its peak: what each of its stages `mine` keeps per micro-batch (its blocks and the
    rest, and before the last stage the output it sent), for the micro-batches in flight."""
    each = [held] if len(mine) == 1 else [_pruned(model, [s]) for s in mine]
    kept = [_activations(e, layout, tensor_parallel_shares(e, layout.tp)[1]) for e in each]
    outputs = [0.0 if s.last else _boundary_bytes(model, layout, stages, s) for s in mine]
    schedule = canonical_schedule(layout.pp_schedule)
    caps, total = in_flight(schedule, layout.pp, layout.micro_batches, len(mine), rank)
    whole = [k[0] + out for k, out in zip(kept, outputs, strict=True)]
    inputs = [k[1] - k[2] + out for k, out in zip(kept, outputs, strict=True)]
    recompute = max(k[2] for k in kept)
    return (
        pipeline_peak(whole, caps, total),
        pipeline_peak(inputs, caps, total) + recompute,
        recompute,
    )


def _pruned(model: Transformer, stages: list[StageLayout]) -> Transformer:
    """A copy of `model` (meta) pruned to `stages` (keep_stages); the blocks it drops are never
    copied (deepcopy's memo maps them to None, and keep_stages deletes those entries)."""
    kept = {str(i) for s in stages for i in s.layers}
    memo = {id(b): None for name, b in model.layers.items() if name not in kept}
    pruned = copy.deepcopy(model, memo)
    keep_stages(pruned, stages)
    return pruned


def _boundary_bytes(
    model: Transformer, layout: Layout, stages: list[StageLayout], stage: StageLayout
) -> float:
    """Bytes of the tensors that cross the end of `stage` for one micro-batch on a rank: the
    residual stream's state after the blocks up to it, T / cp positions, compute dtype."""
    after = sum(len(s.layers) for s in stages[: stage.index + 1])
    B, T = layout.micro_batch_size, layout.seq_len // layout.cp
    shapes = model.stream.boundary_shapes(after, B, T)
    return sum(math.prod(shape) for shape in shapes) * WIDTH[layout.param_dtype]


def _embedding_shard(model: Transformer, layout: Layout) -> float:
    """Elements of the embedding on a rank: its vocabulary rows over tp, FSDP2's shard."""
    return model.embed.weight.numel() / layout.tp / (layout.dp_shard * layout.cp)


def _embedding_copy(model: Transformer, layout: Layout, ranks: list[int]) -> list[float]:
    """Bytes of the last stage's own copy of a shared embedding on each pipeline rank: a V
    schedule's rank 0 holds the first and the last stage (model/stages.py embedding_copy)."""
    copies = [0.0] * layout.pp
    if shares_embedding(model.cfg) and ranks[0] == ranks[-1]:
        copies[ranks[0]] = _embedding_shard(model, layout) * WIDTH[layout.param_dtype]
    return copies


def _pipeline_comm(
    model: Transformer, layout: Layout, stages: list[StageLayout], ranks: list[int], rank: int
) -> float:
    """Bytes pipeline rank `rank` sends per step (comm_pp, module docstring)."""
    m, sent = layout.micro_batches, 0.0
    for stage, at in zip(stages, ranks, strict=True):
        if at != rank:
            continue
        if not stage.last and ranks[stage.index + 1] != rank:  # its output, forward
            sent += m * _boundary_bytes(model, layout, stages, stage)
        if not stage.first and ranks[stage.index - 1] != rank:  # its input's gradient
            sent += m * _boundary_bytes(model, layout, stages, stages[stage.index - 1])
    if shares_embedding(model.cfg) and rank in (ranks[0], ranks[-1]) and ranks[0] != ranks[-1]:
        sent += _ring_all_reduce(_embedding_shard(model, layout) * 4, 2)  # fp32 gradient
    return sent
