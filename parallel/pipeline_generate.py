"""Generation through a pipeline: the model's sampling methods (`new_cache`, `last_logits`) run
stage by stage, each rank keeping the generation state of its own blocks.

`model.generate.generate` takes a `PipelinedModel` as it takes a Transformer: a prefill over the
prompt and then one token per step pass the stages in order (the residual stream's state sent
point to point, as the validation forwards do), and the last stage's logits of the last
position, (B, V), reach every pipeline rank, so every rank draws the same token from the same
generator. The stages' root weights (embedding, final norm, head) are gathered while it is in
use (`PipelineEngine.full_weights`); each block gathers its own in its forward, as in training.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from model.mixers.kv_cache import Cache


@dataclass
class PipelineCache:
    """This rank's generation state: one `Cache` per stage it runs, by stage index."""

    stages: dict[int, Cache]
    capacity: int
    length: int = field(default=0)


class PipelinedModel:
    """The sampling interface of a Transformer over a pipeline's stages (module docstring)."""

    def __init__(self, engine) -> None:
        self.engine = engine  # a PipelineEngine: its plan, stage views and process group

    def new_cache(
        self, batch: int, capacity: int, dtype: torch.dtype | None = None
    ) -> PipelineCache:
        dtype = dtype or self.engine.compute_dtype
        stages = {
            index: view.new_cache(batch, capacity, dtype)
            for index, view in self.engine.stage_views().items()
        }
        return PipelineCache(stages, capacity)

    @torch.no_grad()
    def last_logits(self, tokens: Tensor, *, cache: PipelineCache) -> Tensor:
        """(B, V) logits of the last position of `tokens` (B, T), continuing `cache`."""
        engine = self.engine
        rows, length = tokens.shape
        views = engine.stage_views()
        carried: tuple[Tensor, ...] | None = None
        logits = torch.zeros(rows, engine.model.cfg.vocab_size, device=tokens.device)
        for layout in engine.plan.stages:
            view = views.get(layout.index)
            if view is None:
                carried = None
                continue
            if not layout.first and carried is None:
                carried = engine.receive_state(layout, rows, length)
            state, _ = view._trunk(tokens, None, cache.stages[layout.index], None, carried)
            if layout.last:
                h = view.norm(view.stream.collapse(state))[:, -1]
                logits = view.logits_fn(h, view.head_weight).float()
                break
            carried = tuple(t.to(engine.boundary_dtype) for t in view.stream.to_tensors(state))
            engine.send_state(layout, carried)
        cache.length += length
        return engine.from_last_stage(logits)
