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
from model.mixers.positions import NoPosition


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
