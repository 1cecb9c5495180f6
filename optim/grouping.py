"""Which parameters Muon updates and which AdamW does.

Muon: hidden matrices (attention and FFN projections, expert weight stacks). AdamW: embeddings,
the output head, positions, MoE router weights, and every 1-D parameter (norm gains, biases).
`optim.muon_exclude` adds name patterns (fnmatch, e.g. `layers.0.*`) that stay on AdamW.
`optim.muon_split` splits fused projections (and optionally heads) into separate matrices.
"""

from __future__ import annotations

import logging
from fnmatch import fnmatch

from torch import Tensor, nn

from optim.config import OptimConfig
from optim.matrix_blocks import MatrixBlocks, matrix_blocks

log = logging.getLogger("optim")
ADAMW_MATRICES = ("embed.*", "head.*", "pos.*", "*.router.gate.weight")


def uses_muon(name: str, ndim: int, exclude: list[str]) -> bool:
    return ndim >= 2 and not any(fnmatch(name, p) for p in (*ADAMW_MATRICES, *exclude))


def muon_param_groups(cfg: OptimConfig, model: nn.Module) -> list[dict]:
    """Three groups: muon (decayed), adamw_matrices (decayed), adamw_vectors (no decay)."""
    adamw_lr = cfg.adamw_lr or cfg.lr
    groups = {
        "muon": dict(algorithm="muon", lr=cfg.lr, weight_decay=cfg.weight_decay),
        "adamw_matrices": dict(algorithm="adamw", lr=adamw_lr, weight_decay=cfg.weight_decay),
        "adamw_vectors": dict(algorithm="adamw", lr=adamw_lr, weight_decay=0.0),
    }
    members: dict[str, list] = {key: [] for key in groups}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if uses_muon(name, param.ndim, cfg.muon_exclude):
            members["muon"].append(param)
        else:
            members["adamw_matrices" if param.ndim >= 2 else "adamw_vectors"].append(param)
    for key, params in members.items():
        log.info(
            "optimizer group %s: %d tensors, %s parameters",
            key,
            len(params),
            f"{sum(p.numel() for p in params):,}",
        )
    return [
        {"params": members[key], "name": key, "base_lr": spec["lr"], **spec}
        for key, spec in groups.items()
        if members[key]
    ]


def split_matrices(cfg: OptimConfig, model: nn.Module) -> dict[Tensor, MatrixBlocks]:
    """The Muon weights that are orthogonalized in blocks (optim.muon_split), logged."""
    params = dict(model.named_parameters())
    found = {
        name: blocks
        for name, blocks in matrix_blocks(model, cfg.muon_split).items()
        if uses_muon(name, params[name].ndim, cfg.muon_exclude)
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
