"""Training hooks: the one seam through which a model feature takes part in a training step.

The trainer's step knows no feature. A feature that needs more than the forward (an extra
objective term, a weight set by the schedule, a statistic reduced over ranks, an edit of the
updated weights) implements `TrainingHook` in its own package; the trainer assembles the list
once, after the engine is built, and calls every hook at these points of each step:

  before_step(step, total)   the schedule's position of the step about to be taken
  objective()                after each training forward (micro-batch): a term added to the
                             language-model loss before the backward (None: nothing to add)
  after_backward(reduce)     every micro-batch done, before the update, on every rank (also on a
                             step that is skipped): statistics, reduced over the data-parallel
                             ranks with `reduce(tensor, "sum" | "max")` (in place, collective)
  after_update(weights)      right after an applied optimizer update, on the weights it updated
                             (the fp32 master copy when there is one); under DeepSpeed's ZeRO the
                             optimizer keeps its own fp32 partitions, which only
                             `weights.scale_rows` reaches: edit weights through it where the
                             engine gives one (QK-clip does), other in-place edits would be lost
  end_step(applied)          last, whether or not the update was applied

Under pipeline parallelism each stage's ranks hold their layers' hooks and metrics; the stages'
metrics are merged into one row (`merge_stage_metrics`): per-layer keys are each stage's own, a
summary key that several stages report is their mean weighted by their layers of that feature,
unless the hook's `stage_combine` ({key: "sum" | "max"}) says otherwise.

`start(modules)` runs once on a freshly built engine's weight-holding modules (the running model
first). `after_backward` and `after_update` return metrics ({name: value}) for the log row.

Where the hooks come from: the model's own features (`Transformer.training_hooks()`: MoE
balancing, multi-token prediction, the residual stream's statistics), features registered with
`register_hook_factory` (built per model; a factory returns None where its feature is absent),
and those the trainer adds from settings outside the model (QK-clip from optim, Engram's token
compression from the data's tokenizer). The hooks' order is the order their objective terms add
up in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from torch import Tensor, nn

Reduce = Callable[[Tensor, str], None]  # (tensor, "sum" | "max"): in place, over the DP ranks
RowScaler = Callable[[Tensor, Tensor], None]  # (param, factors (rows,)): param[r] *= factors[r]
Metrics = dict[str, float]


@dataclass(frozen=True)
class UpdatedWeights:
    """The module holding the weights an optimizer update just changed, and how to scale a row
    of one of them (None: in place on the tensor, or on a DTensor's local rows; an engine that
    keeps the updated weights elsewhere, DeepSpeed's ZeRO, gives its own)."""

    module: nn.Module
    scale_rows: RowScaler | None = None


class TrainingHook(Protocol):
    """A feature's part in each training step (see the module docstring). Subclass it for the
    no-op defaults, or implement every method (packages that may not import model/)."""

    # how a summary metric that several pipeline stages report combines ({key: "sum" | "max"};
    # others: the mean weighted by each stage's layers)
    stage_combine: ClassVar[dict[str, str]] = {}

    def start(self, modules: Sequence[nn.Module]) -> None:
        return None

    def before_step(self, step: int, total_steps: int) -> None:
        return None

    def objective(self) -> Tensor | None:
        return None

    def after_backward(self, reduce: Reduce) -> Metrics:
        return {}

    def after_update(self, weights: UpdatedWeights) -> Metrics:
        return {}

    def end_step(self, applied: bool) -> None:
        return None


HookFactory = Callable[[nn.Module], "TrainingHook | None"]
_FACTORIES: dict[str, HookFactory] = {}


def register_hook_factory(name: str, factory: HookFactory) -> None:
    """Add a feature's hook to every run whose hooks are assembled from now on
    (trainer.hooks.start_hooks calls `factory(model)`: its hook, or None where the model lacks
    the feature); registering a name again replaces it."""
    _FACTORIES[name] = factory


def registered_hooks(model: nn.Module) -> list[TrainingHook]:
    """The registered factories' hooks for `model`, in registration order."""
    hooks = (factory(model) for factory in _FACTORIES.values())
    return [hook for hook in hooks if hook is not None]


def stage_combines(hooks: Sequence[TrainingHook]) -> dict[str, str]:
    """Every hook's `stage_combine`, merged."""
    out: dict[str, str] = {}
    for hook in hooks:
        out |= getattr(hook, "stage_combine", {})
    return out


def merge_stage_metrics(parts: Sequence[Metrics], combine: dict[str, str]) -> Metrics:
    """The metrics of every pipeline stage as one row (see the module docstring)."""
    merged: dict[str, list[tuple[float, int]]] = {}
    for part in parts:
        for key, value in part.items():
            prefix = key.split("/")[0] + "/layer"
            layers = sum(1 for k in part if k.startswith(prefix)) or 1
            merged.setdefault(key, []).append((value, layers))
    out: Metrics = {}
    for key, values in merged.items():
        how = combine.get(key, "mean")
        if how == "sum":
            out[key] = sum(v for v, _ in values)
        elif how == "max":
            out[key] = max(v for v, _ in values)
        else:
            out[key] = sum(v * w for v, w in values) / sum(w for _, w in values)
    return out


def objective_with(hooks: Sequence[TrainingHook]) -> Callable[[Tensor], Tensor]:
    """The loss to backpropagate: `loss` plus every hook's term, added in the hooks' order."""

    def objective(loss: Tensor) -> Tensor:
        for hook in hooks:
            term = hook.objective()
            if term is not None:
                loss = loss + term
        return loss

    return objective
