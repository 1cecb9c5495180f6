"""Pipeline stages of the model: which blocks a stage runs, and the model pruned to them.

Shapes: B batch, T tokens, C d_model. A pipeline splits the stack of blocks into `count`
contiguous stages; stage s runs its blocks on what stage s - 1 sent (the residual stream's state
as tensors, `ResidualStream.to_tensors`), and every stage gets the micro-batch's token ids,
targets and document ids beside it, so each builds its own attention context (positions, RoPE,
masks, Engram's hashed ids) from the whole row. The first stage holds the embedding (and a
learned position table), the last the final norm, the head, the loss and the MTP modules; with
tied embeddings or MTP the last stage holds a copy of the embedding too, whose gradient the
pipeline sums with the first stage's (`shares_embedding`), so both copies stay equal.

`keep_stages(model, layouts)` prunes a model built on the meta device to this rank's stages (one,
or two for the interleaved and V schedules), in place: the parameter names stay those of the
whole model (`layers.5.attn.q_proj.weight`), so checkpoints load across pipeline layouts.
A rank that holds both the first and the last stage (the V schedules) gives the last stage a
copy of the embedding of its own (`embedding_copy`): its gradient is added to the first's and the
update copied back, so it never appears in checkpoints.
`stage_view(model, layout)` is one stage of a pruned model as a module of its own (sharing its
blocks) that `torch.distributed.pipelining.PipelineStage` runs; its forward is
`Transformer.forward` in stage form (`Transformer.stage_forward`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from model.config import ModelConfig
from model.errors import ConfigError
from model.mixers.positions import NoPosition

# torch.distributed.pipelining's schedules (parallel/pipeline_split.py runs them)
SCHEDULES = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
MULTI_STAGE = SCHEDULES[2:]  # several stages per rank (2 by default)
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")  # stages placed in a V: first and last on rank 0
# the schedules that run a stage's backward as an input pass and a later weight pass
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


@dataclass(frozen=True)
class StageLayout:
    """One pipeline stage: its index among `count` and the blocks it runs, in order."""

    index: int
    count: int
    layers: tuple[int, ...]

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def describe(self) -> str:
        parts = ["embedding"] if self.first else []
        if self.layers:
            lo, hi = self.layers[0], self.layers[-1]
            parts.append(f"layers {lo}-{hi}" if hi > lo else f"layer {lo}")
        if self.last:
            parts.append("head + loss")
        return f"stage {self.index}: " + ", ".join(parts)


def shares_embedding(cfg: ModelConfig) -> bool:
    """Whether the last stage reads the embedding too (a tied head, or the MTP modules' inputs)."""
    return cfg.tie_embeddings or cfg.mtp.depth > 0


def holds_embedding(cfg: ModelConfig, layouts: Sequence[StageLayout]) -> bool:
    first = any(layout.first for layout in layouts)
    last = any(layout.last for layout in layouts)
    return first or (last and shares_embedding(cfg))


def keep_stages(model: nn.Module, layouts: Sequence[StageLayout]) -> None:
    """Prune `model` (a Transformer, on the meta device) in place to the union of `layouts`."""
    cfg: ModelConfig = model.cfg
    kept = {str(i) for layout in layouts for i in layout.layers}
    for name in [name for name in model.layers if name not in kept]:
        del model.layers[name]
    first = any(layout.first for layout in layouts)
    last = any(layout.last for layout in layouts)
    if not holds_embedding(cfg, layouts):
        model.embed = None
    if not first and any(True for _ in model.pos.parameters()):
        model.pos = NoPosition(cfg)  # a learned table: added after the embedding only
    if not last:
        model.norm = None
        model.head = None
        model.mtp = None
        _drop_children(model.stream)  # its parameters collapse the state: the last stage's
    model.pipeline_stages = tuple(layouts)


def _drop_children(module: nn.Module) -> nn.Module:
    for name in list(module._modules):
        module._modules[name] = None
    return module


def stage_view(model: nn.Module, layout: StageLayout) -> nn.Module:
    """Stage `layout` of a pruned model as a module of its own: a shallow copy whose blocks,
    embedding and head are the model's own (the same parameters), without the model's other
    stage; the model itself when it holds this stage alone."""
    if model.pipeline_stages == (layout,):
        view = model
    else:
        view = _shallow_copy(model)
        view.layers = _shallow_copy(model.layers)  # pruned apart from the model's
        if not layout.last:  # before pruning: the model's own stream keeps its parameters
            view.stream = _drop_children(_shallow_copy(model.stream))
        elif shares_embedding(model.cfg) and any(s.first for s in model.pipeline_stages):
            # the first stage is on this rank too (a V schedule): the last gets a copy of the
            # embedding of its own (`embedding_copy`), which the engine keeps equal
            view.embed = copy.deepcopy(model.embed)
        keep_stages(view, [layout])
    view.stage = layout
    view.forward = view.stage_forward
    return view


def embedding_copy(model: nn.Module, views: Sequence[nn.Module]) -> nn.Module | None:
    """The last stage's own copy of the embedding, when this rank holds the first stage too."""
    for view in views:
        if view is not model and view.embed is not None and view.embed is not model.embed:
            return view.embed
    return None


def _shallow_copy(module: nn.Module) -> nn.Module:
    """A copy sharing the children and parameters, with registries and hook tables of its own."""
    copied = copy.copy(module)
    for key, value in vars(module).items():
        if isinstance(value, (dict, set)):
            setattr(copied, key, copy.copy(value))
    return copied


def stage_rank(stage: int, pp: int, v_style: bool) -> int:
    """The pipeline rank that runs `stage`: stage % pp (\"loop\"), or in a V: rank s for s < pp,
    2 pp - 1 - s after."""
    if v_style and stage >= pp:
        return 2 * pp - 1 - stage
    return stage % pp


def layer_costs(model, seq_len: int) -> tuple[list[float], float]:
    """(each block's training FLOPs per token, the head's and MTP's) of a whole model (meta)."""
    from model.accounting import matmul_params_per_token  # (it imports the Transformer)

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
    if len(counts) != stages or sum(counts) != n_layers or min(counts) < 1:
        raise ConfigError(
            f"parallel.pp_layers={counts} must list the layers of each of the {stages} stages "
            f"(pp x stages per rank; at least 1 each), summing to model.n_layers={n_layers}"
        )
    out, start = [], 0
    for count in counts:
        out.append(tuple(range(start, start + count)))
        start += count
    return out


def canonical_schedule(name: str) -> str:
    """A schedule's name as torch spells it (parallel.pp_schedule is case-insensitive)."""
    for known in SCHEDULES:
        if known.lower() == name.lower():
            return known
    raise ConfigError(f"parallel.pp_schedule={name!r} is not one of {', '.join(SCHEDULES)}")


def stages_per_rank(schedule: str, requested: int) -> int:
    """Stages each pipeline rank runs (parallel.pp_stages_per_rank; 0 = the schedule's own)."""
    name = canonical_schedule(schedule)
    multi = name in MULTI_STAGE
    if requested == 0:
        return 2 if multi else 1
    if not multi and requested != 1:
        raise ConfigError(
            f"parallel.pp_schedule={schedule} runs one stage per rank; "
            f"parallel.pp_stages_per_rank={requested} needs a multi-stage schedule "
            f"({', '.join(MULTI_STAGE)})"
        )
    if name in V_SCHEDULES and requested != 2:
        raise ConfigError(
            f"parallel.pp_schedule={schedule} places two stages per rank in a V; "
            f"parallel.pp_stages_per_rank={requested} must be 2 (or 0)"
        )
    return requested


def pipeline_layouts(
    model, seq_len: int, pp: int, schedule: str, per_rank: int, layers: Sequence[int]
) -> list[StageLayout]:
    """Every stage of a whole model (built on the meta device) for `pp` pipeline ranks."""
    count = pp * stages_per_rank(schedule, per_rank)
    n_layers = len(model.layers)
    if layers:
        split = explicit_layers(list(layers), n_layers, count)
    else:
        costs, head = layer_costs(model, seq_len)
        split = split_layers(costs, head, count)
    return [StageLayout(i, count, blocks) for i, blocks in enumerate(split)]
