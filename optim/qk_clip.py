"""QK-clip (MuonClip): cap every attention head's max logit at tau by rescaling its weights.

Softmax-attention mixers implement the optional QK-clip protocol (`model.mixers.mixer.QKClipHooks`);
other layer kinds (linear attention) do not, and are skipped:
- `record_max_logits` (bool) and `max_logits` ((H,) running max of q.k x scale over the
  training forwards since it was last read), `reset_max_logits()` (back to -inf);
- `qk_clip_row_scales(gamma)`: (parameter, per-row factor) pairs that scale head h's logits by
  gamma[h] (MHA: sqrt(gamma) on W_q and W_k rows; GQA: gamma on W_q rows; MLA: sqrt(gamma) on
  q_nope and k_nope rows, gamma on q_rope rows);
- `qk_clip_blocker()`: why a layer cannot be clipped (e.g. QK-norm), or None.

`QKClip` is the trainer's training hook (model.training_hooks, implemented here without
importing model/): after the backward it all-reduces the step's (L, H) max logits with MAX over
ranks; after an applied optimizer update it calls `apply_qk_clip` on the updated weights: heads
above tau get gamma = tau / max_logit, the rest gamma = 1 (their weights untouched). Sharded
(DTensor) weights are scaled on their local rows. A skipped step's logits are dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from optim.errors import OptimConfigError


def clip_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "qk_clip_row_scales")]


def enable_qk_clip(model: nn.Module) -> None:
    """Turn on max-logit recording; QK-norm already bounds logits and defeats weight scaling."""
    layers = clip_layers(model)
    if not layers:
        raise OptimConfigError("QK-clip needs attention layers with qk_clip_row_scales")
    for name, module in layers:
        blocker = module.qk_clip_blocker()
        if blocker:
            raise OptimConfigError(f"{name} {blocker}; use optim=muon")
        module.record_max_logits = True
        module.reset_max_logits()  # (H,) -inf: the running max is a tensor from the first forward
    # the recording mutates the module inside checkpointed blocks; replaying it in the recompute
    # changes nothing (the same max), so let dynamo trace those blocks instead of falling back
    dynamo_config = torch._dynamo.config
    if hasattr(dynamo_config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        dynamo_config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def pop_max_logits(model: nn.Module) -> Tensor | None:
    """(L, H) max logits recorded since the last call (-inf for a head without a training
    forward since), and start again; None where recording is off."""
    logits = []
    for _, module in clip_layers(model):
        if module.max_logits is None:
            return None
        logits.append(module.max_logits)
        module.reset_max_logits()
    return torch.stack(logits)


RowScaler = Callable[[Tensor, Tensor], None]  # (param, per-row factor): param[r] *= factor[r]


@torch.no_grad()
def apply_qk_clip(
    model: nn.Module, max_logits: Tensor, tau: float, scale: RowScaler | None = None
) -> dict[str, float]:
    """Rescale heads whose max logit exceeds tau; returns logging statistics. `scale`: how a
    weight's rows are scaled (default `scale_rows`; an engine whose optimizer keeps the weights
    elsewhere, DeepSpeed's ZeRO, brings its own)."""
    scale = scale or scale_rows
    peaks = max_logits.float()
    over = peaks > tau  # only these heads change (tau / peak could round below 1 at peak == tau)
    gammas = torch.where(over, tau / peaks.clamp(min=1e-30), torch.ones_like(peaks))  # (L, H)
    stats: dict[str, float] = {}
    layer_peaks = peaks.amax(dim=1).tolist()  # one device-to-host copy for the logging
    layer_clipped = over.any(dim=1).tolist()
    for (name, module), gamma, peak, clipped in zip(
        clip_layers(model), gammas, layer_peaks, layer_clipped
    ):
        if clipped:
            for param, rows in module.qk_clip_row_scales(gamma):
                scale(param, rows)
        if peak == float("-inf"):  # no training forward since the last read: nothing to log
            continue  # (-inf is not JSON, and wandb rejects it)
        layer = name.split(".")[1] if name.startswith("layers.") else name
        stats[f"qk/layer{layer}/max_logit"] = peak
    if max(layer_peaks, default=float("-inf")) > float("-inf"):
        stats["qk/max_logit"] = max(layer_peaks)
    stats["qk/clipped_heads"] = float(sum(over.sum(dim=1).tolist()))
    return stats


def scale_rows(param: Tensor, rows: Tensor) -> None:
    """param[r, ...] *= rows[r], on this rank's rows when param is a dim-0-sharded DTensor."""
    factor = rows.to(param.dtype).view(-1, *([1] * (param.dim() - 1)))
    if isinstance(param, DTensor):
        full = factor.expand(param.shape).contiguous()
        mesh, placements = param.device_mesh, param.placements
        param.to_local().mul_(
            distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()
        )
    else:
        param.mul_(factor)


class QKClip:
    """MuonClip's QK-clip as a training hook (the protocol of model.training_hooks): recording
    starts with `start`, every step's max logits are reduced with MAX over the ranks after the
    backward and cap the weights after an applied update (qk/... metrics)."""

    stage_combine: ClassVar[dict[str, str]] = {
        "qk/max_logit": "max",
        "qk/clipped_heads": "sum",
    }  # (pipeline stages)

    def __init__(self, tau: float) -> None:
        self.tau = tau
        self.model: nn.Module | None = None  # the running model (its layers record)
        self.logits: Tensor | None = None  # (L, H) this step's max logits over every rank

    def start(self, modules: Sequence[nn.Module]) -> None:
        self.model = modules[0]
        enable_qk_clip(self.model)

    def before_step(self, step: int, total_steps: int) -> None:
        return None

    def objective(self) -> Tensor | None:
        return None

    def after_backward(self, reduce: Callable[[Tensor, str], None]) -> dict[str, float]:
        self.logits = pop_max_logits(self.model)
        if self.logits is not None:
            reduce(self.logits, "max")
        return {}

    def after_update(self, weights: Any) -> dict[str, float]:
        """`weights`: model.training_hooks.UpdatedWeights (the module the update changed)."""
        if self.logits is None:
            return {}
        return apply_qk_clip(weights.module, self.logits, self.tau, weights.scale_rows)

    def end_step(self, applied: bool) -> None:
        self.logits = None
