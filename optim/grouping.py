"""Which parameters Muon updates and which AdamW does, from the parameters' declared roles.

Each module declares its parameters' roles (model/roles.py); optim/roles.py gives each role its
settings. Muon: the roles it orthogonalizes (matrices: attention and FFN projections; expert
weight stacks). AdamW: everything else, with weight decay for decayed roles (embeddings, the
output head, router weights) and without for the rest (norm gains, biases, conv kernels, mixing
weights). `optim.muon_exclude` adds name patterns (fnmatch, e.g. `layers.0.*`) that stay on
AdamW. `optim.muon_split` splits fused projections (and optionally heads) into separate matrices.
A role with an lr multiplier other than 1 gets a group of its own.
"""

from __future__ import annotations

import logging
from fnmatch import fnmatch

from torch import Tensor, nn

from model.roles import EXPERT_STACK, MATRIX, param_roles
from optim.config import OptimConfig
from optim.errors import OptimConfigError
from optim.matrix_blocks import MatrixBlocks, matrix_blocks
from optim.roles import ROLE_SETTINGS, role_settings
from optim.row_adam import ALGORITHM as ROW_ADAM

log = logging.getLogger("optim")
MUON_SHAPES = {MATRIX: 2, EXPERT_STACK: 3}  # tensor rank each Muon role must have


def muon_names(model: nn.Module, exclude: list[str]) -> dict[str, str]:
    """Name -> role of the parameters Muon orthogonalizes (checked to have the role's shape)."""
    params = dict(model.named_parameters())
    out = {}
    for name, role in param_roles(model).items():
        if not ROLE_SETTINGS[role].muon or any(fnmatch(name, p) for p in exclude):
            continue
        if params[name].ndim != MUON_SHAPES[role]:
            raise OptimConfigError(
                f"{name} is declared {role!r} but has shape {tuple(params[name].shape)} "
                f"(a {role} is {MUON_SHAPES[role]}-D)"
            )
        out[name] = role
    return out


def group_key(base: str, multiplier: float) -> str:
    return base if multiplier == 1.0 else f"{base}_x{multiplier:g}"


def role_groups(model: nn.Module, cfg: OptimConfig, muon: bool) -> list[dict]:
    """Param groups by role: under Muon `muon`, `adamw_matrices` (decayed) and `adamw_vectors`
    (not decayed); under AdamW alone `matrices` and `vectors`; plus `<name>_x<m>` groups for
    roles with an lr multiplier m != 1 (those carry `kind`, the group whose peak lr they scale,
    and `lr_multiplier`). `optim.builder.apply_config` sets every group's peak lr and decay."""
    roles = param_roles(model)
    on_muon = muon_names(model, cfg.muon_exclude) if muon else {}
    names = ("muon", "adamw_matrices", "adamw_vectors") if muon else ("", "matrices", "vectors")
    groups: dict[str, dict] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        settings = role_settings(roles[name], cfg.memory_lr_multiplier)
        base = names[0] if name in on_muon else names[1] if settings.weight_decay else names[2]
        key = group_key("memory" if settings.rows else base, settings.lr_multiplier)
        if key not in groups:
            groups[key] = {
                "params": [],
                "name": key,
                "weight_decay": cfg.weight_decay if settings.weight_decay else 0.0,
            }
            if settings.lr_multiplier != 1.0 or settings.rows:  # (the default groups keep keys)
                groups[key] |= {"kind": base, "lr_multiplier": settings.lr_multiplier}
            if muon:
                groups[key]["algorithm"] = "muon" if base == "muon" else "adamw"
            if settings.rows:
                groups[key]["algorithm"] = ROW_ADAM
        groups[key]["params"].append(param)
    order = {n: i for i, n in enumerate(names)}  # the fixed groups first, in this order
    ordered = sorted(groups.values(), key=lambda g: (order.get(g["name"], len(order)), g["name"]))
    for group in ordered:
        params = group["params"]
        log.info(
            "optimizer group %s: %d tensors, %s parameters",
            group["name"],
            len(params),
            f"{sum(p.numel() for p in params):,}",
        )
    return ordered


def muon_param_groups(cfg: OptimConfig, model: nn.Module) -> list[dict]:
    """Three groups (and any lr-multiplier groups): muon (decayed), adamw_matrices (decayed),
    adamw_vectors (no decay)."""
    return role_groups(model, cfg, muon=True)


def split_matrices(cfg: OptimConfig, model: nn.Module) -> dict[Tensor, MatrixBlocks]:
    """The Muon weights that are orthogonalized in blocks (optim.muon_split), logged."""
    params = dict(model.named_parameters())
    on_muon = muon_names(model, cfg.muon_exclude)
    found = {
        name: blocks
        for name, blocks in matrix_blocks(model, cfg.muon_split).items()
        if name in on_muon
    }
    if found:
        matrices = sum(
            b.heads * len(b.parts) if b.per_head else len(b.parts) for b in found.values()
        )
        log.info(
            "muon_split=%s: %d weights orthogonalized as %d matrices",
            cfg.muon_split,
            len(found),
            matrices,
        )
    return {params[name]: blocks for name, blocks in found.items()}
