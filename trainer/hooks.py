"""The run's training hooks (model.training_hooks), assembled once from the model and settings.

The model's own features come first (`Transformer.training_hooks()`: residual-stream metrics,
MoE balancing, multi-token prediction), then registered ones (`register_hook_factory`), then what
the trainer adds from settings outside the model: Engram's token compression (the data's
tokenizer) and QK-clip (optim.qk_clip_tau).
"""

from __future__ import annotations

from torch import Tensor

from model.engram.layer import CompressTokens
from model.training_hooks import TrainingHook, registered_hooks
from optim.qk_clip import QKClip
from parallel.engine import TrainingEngine


def start_hooks(
    engine: TrainingEngine, qk_clip_tau: float, canonical: Tensor | None
) -> list[TrainingHook]:
    """Every hook of this run, started on the freshly built `engine`'s weight-holding modules."""
    model = engine.model
    hooks: list[TrainingHook] = [*model.training_hooks(), *registered_hooks(model)]
    if canonical is not None:  # Engram's canonical ids (trainer.app.token_compression)
        hooks.append(CompressTokens(canonical))
    if qk_clip_tau > 0:  # attention layers record their per-head max logits from now on
        hooks.append(QKClip(qk_clip_tau))
    for hook in hooks:
        hook.start(engine.weight_modules())
    return hooks
