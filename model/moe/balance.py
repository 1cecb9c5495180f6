"""Model-level MoE hooks for the trainer: balance losses, expert load, aux-loss-free bias updates and
logging statistics. L_moe MoE layers, E routed experts each.

Per optimizer step the trainer's `MoEBalance` hook (model.training_hooks)
  1. adds `pop_aux_loss(model)` (None when no balance loss is configured) to each micro-batch loss
     before its backward;
  2. after the backward, all-reduces `expert_load(model)` (L_moe, E) over data-parallel ranks
     (one collective) and calls `moe_stats(model, load)` to log; after an applied update,
     `apply_bias_update(model, load)`, which also resets the counters.

`moe_stats` keys (stable; i is the block index of the MoE layer):
  moe/layer{i}/imbalance     max / mean tokens per expert (1 = balanced; 0 when nothing counted)
  moe/layer{i}/dropped_frac  dropped / routed token slots since the last reset (this rank's tokens)
  moe/layer{i}/bias_min      min of the selection bias (aux-loss-free balancing)
  moe/layer{i}/bias_max      max of the selection bias
  moe/layer{i}/aux_loss      Switch balance loss of the last training forward, unweighted (1 = balanced)
  moe/layer{i}/seq_aux_loss  sequence-wise balance loss of the last training forward, unweighted
  moe/layer{i}/z_loss        router z-loss of the last training forward, unweighted
  moe/imbalance              mean over layers of imbalance
  moe/dropped_frac           mean over layers of dropped_frac
  moe/aux_loss               sum over layers of the coefficient-weighted balance losses of the last
                             training forward: what pop_aux_loss adds to the loss
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor, nn

from model.moe.layer import MoE
from model.training_hooks import Reduce, TrainingHook


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE layers in module order (block order)."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def pop_aux_loss(model: nn.Module) -> Tensor | None:
    """Sum of the weighted balance losses of every MoE layer since the last pop (all forwards), and
    forget them; None when there are none (no coefficient set, or no training forward)."""
    losses = [loss for layer in moe_layers(model) for loss in layer.pop_aux_losses()]
    return torch.stack(losses).sum() if losses else None


def expert_load(model: nn.Module) -> Tensor:
    """(L_moe, E) fp32 tokens routed to each expert since the last reset (this rank's tokens)."""
    layers = moe_layers(model)
    if not layers:
        return torch.zeros(0, 0)
    return torch.stack([layer.tokens_per_expert for layer in layers])


def reset_moe_stats(model: nn.Module) -> None:
    """Zero the load counters of every MoE layer."""
    with torch.no_grad():
        for layer in moe_layers(model):
            layer.tokens_per_expert.zero_()
            layer.dropped_tokens.zero_()


@torch.no_grad()
def apply_bias_update(model: nn.Module, global_load: Tensor) -> None:
    """Aux-loss-free balancing (DeepSeek-V3): bias += gamma sign(mean(load) - load) per layer with
    bias_update_rate gamma > 0, in fp32; then reset the counters. global_load (L_moe, E)."""
    layers = moe_layers(model)
    if tuple(global_load.shape) != (len(layers), layers[0].n_experts if layers else 0):
        raise ValueError(
            f"global_load has shape {tuple(global_load.shape)}; expected (MoE layers, experts) = "
            f"({len(layers)}, {layers[0].n_experts if layers else 0})"
        )
    for layer, load in zip(layers, global_load):
        rate = layer.cfg.bias_update_rate
        if rate > 0:
            bias = layer.router.expert_bias
            load = load.to(bias.device, torch.float32)
            bias.add_(rate * torch.sign(load.mean() - load))
    reset_moe_stats(model)


@torch.no_grad()
def moe_stats(model: nn.Module, global_load: Tensor | None = None) -> dict[str, float]:
    """Flat logging statistics (keys in the module docstring); the load is `global_load` when given
    (e.g. all-reduced over ranks), else this rank's counters."""
    layers = moe_layers(model)
    if not layers:
        return {}
    load = expert_load(model) if global_load is None else global_load.float()
    load = load.to(layers[0].tokens_per_expert.device)
    mean = load.mean(dim=1)
    imbalance = torch.where(mean > 0, load.amax(dim=1) / mean.clamp(min=1e-30), 0.0)
    kept = torch.stack([layer.tokens_per_expert.sum() for layer in layers])
    dropped = torch.stack([layer.dropped_tokens for layer in layers])
    routed = kept + dropped
    dropped_frac = torch.where(routed > 0, dropped / routed.clamp(min=1), 0.0)
    rows = []  # per layer: imbalance, dropped_frac, bias_min, bias_max, 3 losses, weighted
    zero = torch.zeros((), device=load.device)
    for i, layer in enumerate(layers):
        bias = layer.router.expert_bias.float()
        losses = [layer.last_losses.get(k, zero) for k in ("aux_loss", "seq_aux_loss", "z_loss")]
        weighted = layer.last_losses.get("weighted", zero)
        rows.append(
            torch.stack(
                [imbalance[i], dropped_frac[i], bias.min(), bias.max(), *losses, weighted]
            ).to(load.device)
        )
    table = torch.stack(rows).tolist()  # one device sync
    out: dict[str, float] = {}
    names = (
        "imbalance",
        "dropped_frac",
        "bias_min",
        "bias_max",
        "aux_loss",
        "seq_aux_loss",
        "z_loss",
    )
    for layer, row in zip(layers, table):
        for name, value in zip(names, row):
            out[f"moe/layer{layer.layer_id}/{name}"] = value
    out["moe/imbalance"] = sum(row[0] for row in table) / len(table)
    out["moe/dropped_frac"] = sum(row[1] for row in table) / len(table)
    out["moe/aux_loss"] = sum(row[7] for row in table)
    return out


class MoEBalance(TrainingHook):
    """MoE balancing as a training hook: the balance losses join each micro-batch's objective;
    after the backward the step's expert loads (all micro-batches) are summed over the ranks in
    one all-reduce and give the moe/ statistics; an applied step updates the aux-loss-free
    biases from them (the same update on every rank); every step clears the counters."""

    stage_combine: ClassVar[dict[str, str]] = {"moe/aux_loss": "sum"}  # (summed over layers)

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.load: Tensor | None = None  # (L_moe, E) the step's loads over every rank

    def objective(self) -> Tensor | None:
        return pop_aux_loss(self.model)

    def after_backward(self, reduce: Reduce) -> dict[str, float]:
        self.load = expert_load(self.model)
        reduce(self.load, "sum")
        return moe_stats(self.model, self.load)

    def end_step(self, applied: bool) -> None:
        if applied:
            apply_bias_update(self.model, self.load)
        reset_moe_stats(self.model)
        self.load = None


def moe_balance_hook(model: nn.Module) -> MoEBalance | None:
    """The hook of a model with MoE layers; None for a dense one."""
    return MoEBalance(model) if moe_layers(model) else None
