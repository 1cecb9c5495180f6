"""Build the optimizer named by `optim.name` from a model's parameters.

Parameter groups come from the parameters' declared roles (optim.grouping, optim.roles): under
AdamW, `matrices` (projections, embeddings, the head, routers) take weight decay and `vectors`
(norm gains, biases, conv kernels, mixing weights) do not. `optim=muon`: Muon for the matrix
roles, AdamW for the rest, in one optimizer (optim.muon). Engram's tables form a `memory_x<m>`
group updated row-wise under either (optim.row_adam).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from optim.config import OptimConfig
from optim.errors import OptimConfigError
from optim.grouping import group_key, muon_param_groups, role_groups, split_matrices
from optim.muon import Muon
from optim.row_adam import ALGORITHM as ROW_ADAM
from optim.row_adam import AdamWWithTables


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """AdamW's groups by role: decayed `matrices`, undecayed `vectors` (the schedule scales each
    group's base_lr, which apply_config sets)."""
    return role_groups(model, cfg, muon=False)


def _muon(cfg: OptimConfig, model: nn.Module) -> torch.optim.Optimizer:
    groups = muon_param_groups(cfg, model)
    for group in groups:  # the starting lr, until the schedule sets it: the group's peak
        muon = group.get("kind", group["name"]) == "muon"
        group["lr"] = cfg.lr if muon else (cfg.adamw_lr or cfg.lr)
    return Muon(
        groups,
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
    groups = param_groups(model, cfg)
    rows = any(g.get("algorithm") == ROW_ADAM for g in groups)
    return (AdamWWithTables if rows else torch.optim.AdamW)(
        groups,
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
        if group.get("algorithm") == ROW_ADAM:  # the multiplier given now (a resume may change it)
            group["lr_multiplier"] = cfg.memory_lr_multiplier
            group["name"] = group_key("memory", cfg.memory_lr_multiplier)
        kind = group.get("kind", group.get("name", ""))
        group["base_lr"] = peak.get(kind, cfg.lr) * group.get("lr_multiplier", 1.0)
        group["weight_decay"] = decay.get(kind, cfg.weight_decay)
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
