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
from optim.grouping import muon_param_groups
from optim.muon import Muon


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay, "name": "matrices"},
        {"params": no_decay, "weight_decay": 0.0, "name": "vectors"},
    ]


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


OPTIMIZERS: dict[str, Callable[[OptimConfig, nn.Module], torch.optim.Optimizer]] = {
    "adamw": _adamw,
    "muon": _muon,
    "muonclip": _muon,  # the same optimizer; the trainer applies QK-clip after each step
}


def build_optimizer(cfg: OptimConfig, model: nn.Module) -> torch.optim.Optimizer:
    if cfg.name not in OPTIMIZERS:
        raise OptimConfigError(
            f"optim.name={cfg.name!r} is not available; choose one of: {', '.join(OPTIMIZERS)}"
        )
    return OPTIMIZERS[cfg.name](cfg, model)
