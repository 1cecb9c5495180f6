"""Build the optimizer named by `optim.name` from a model's parameters.

Parameter groups: matrices (ndim >= 2: projections, embeddings, the head) take weight decay;
vectors (norm gains, biases) do not. `optim=muon`: Muon for hidden matrices, AdamW for the rest
(optim.grouping), in one optimizer (optim.muon).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from optim.config import OptimConfig
from optim.errors import OptimConfigError
from optim.grouping import muon_param_groups, split_matrices
from optim.muon import Muon


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay, "name": "matrices"},
        {"params": no_decay, "weight_decay": 0.0, "name": "vectors"},
    ]  # the schedule scales each group's base_lr (apply_config sets it)


def _muon(cfg: OptimConfig, model: nn.Module) -> torch.optim.Optimizer:
    return Muon(
        muon_param_groups(cfg, model),
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        momentum=cfg.muon_momentum,
        nesterov=cfg.muon_nesterov,
        ns_steps=cfg.ns_steps,
        ns_schedule=cfg.ns_schedule,
        scaling=cfg.muon_scaling,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        blocks=split_matrices(cfg, model),
    )


def _adamw(cfg: OptimConfig, model: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    # the fused kernel (one launch for all tensors) exists on CPU and CUDA for float params
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=fused or None,
    )


BUILDERS: dict[str, Callable[[OptimConfig, nn.Module], torch.optim.Optimizer]] = {
    "adamw": _adamw,
    "muon": _muon,
    "muonclip": _muon,  # the same optimizer; the trainer applies QK-clip after each step
}


def build_optimizer(cfg: OptimConfig, model: nn.Module) -> torch.optim.Optimizer:
    if cfg.name not in BUILDERS:
        raise OptimConfigError(
            f"optim.name={cfg.name!r} is not available; choose one of: {', '.join(BUILDERS)}"
        )
    optimizer = BUILDERS[cfg.name](cfg, model)
    apply_config(optimizer, cfg)
    return optimizer


def apply_config(optimizer: torch.optim.Optimizer, cfg: OptimConfig) -> None:
    """Set every group's hyperparameters from `cfg` (by group name). A loaded checkpoint brings
    back the saved ones; after a resume the config given now must win (e.g. a lowered lr)."""
    adamw_lr = (cfg.adamw_lr or cfg.lr) if cfg.name != "adamw" else cfg.lr
    peak = {"muon": cfg.lr, "adamw_matrices": adamw_lr, "adamw_vectors": adamw_lr}
    decay = {"adamw_vectors": 0.0, "vectors": 0.0}
    for group in optimizer.param_groups:
        name = group.get("name", "")
        group["base_lr"] = peak.get(name, cfg.lr)
        group["weight_decay"] = decay.get(name, cfg.weight_decay)
        group["betas"] = (cfg.beta1, cfg.beta2)
        group["eps"] = cfg.eps
        if group.get("algorithm") == "muon":
            group.update(
                momentum=cfg.muon_momentum,
                nesterov=cfg.muon_nesterov,
                ns_steps=cfg.ns_steps,
                ns_schedule=cfg.ns_schedule,
                scaling=cfg.muon_scaling,
            )
