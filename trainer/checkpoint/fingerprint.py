"""What a checkpoint and the run resuming it must agree on: the model and the optimizer's shape.

A checkpoint stores the resolved model config (vocabulary included) and the optimizer settings
that decide its parameter groups and state; everything else (learning rates, schedule, clip,
batch size, layout over ranks) may change on resume. Loading weights into another model would
fail deep inside DCP or, worse, silently load a subset (fewer layers), so the comparison comes
first and names every differing key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from model.config import ModelConfig
from optim.config import OptimConfig

# model fields that choose how a result is computed, not what it is: free to change on resume
COMPUTE_ONLY = frozenset(
    {
        "gdn.chunk_size",
        "gdn.kernel",
        "kda.chunk_size",
        "kda.kernel",
        "mhc.recompute_maps",
        "engram.offload",  # where the tables live
        "engram.sparse_grad",  # the same update from sparse or dense table gradients
        "engram.sharding",  # how ranks hold the tables; checkpoints hold them whole
        "mtp.weight",  # lambda and its schedule: training hyperparameters, like the lr
        "mtp.final_weight",
        "mtp.switch_fraction",
    }
)
# optimizers with the same state (muonclip is muon plus a weight rescale after each step)
OPTIMIZER_FAMILY = {"muonclip": "muon"}


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> {"attention.n_heads": 4, ...}; tuples become lists (as JSON gives them)."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out |= _flat(item, f"{prefix}{key}.")
        return out
    if isinstance(value, tuple):
        value = list(value)
    return {prefix.rstrip("."): value}


@dataclass(frozen=True)
class Fingerprint:
    model: dict[str, Any]  # flat resolved ModelConfig
    optim: dict[str, Any]  # optimizer family and its grouping settings

    @classmethod
    def of(cls, model: ModelConfig, optim: OptimConfig) -> Fingerprint:
        family = OPTIMIZER_FAMILY.get(optim.name, optim.name)
        groups = {"name": family}
        if family == "muon":
            groups["muon_exclude"] = list(optim.muon_exclude)
        return cls(_flat(dataclasses.asdict(model)), groups)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "optim": self.optim}

    def differences(self, extra: dict[str, Any]) -> list[str]:
        """`model.d_model=64 in the checkpoint, 96 now`, ... (empty when they agree). Older
        checkpoints without a fingerprint are compared by their stored model config alone."""
        saved = extra.get("fingerprint")
        if saved is None:
            saved = {"model": _flat(extra.get("model_config", {})), "optim": self.optim}
        out = []
        for group, mine in (("model", self.model), ("optim", self.optim)):
            theirs = saved.get(group, {})
            if group == "model":  # a field newer than the checkpoint had its default there
                theirs = _model_defaults() | theirs
            for key in sorted(set(mine) | set(theirs)):
                if group == "model" and key in COMPUTE_ONLY:
                    continue
                if _flat(theirs.get(key)) != _flat(mine.get(key)):
                    then, now = theirs.get(key, "<absent>"), mine.get(key, "<absent>")
                    out.append(f"{group}.{key}={then} in the checkpoint, {now} now")
        return out


def _model_defaults() -> dict[str, Any]:
    """The flat default ModelConfig: what a checkpoint older than a field was written with."""
    return _flat(dataclasses.asdict(ModelConfig()))
