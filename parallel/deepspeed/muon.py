"""Muon under DeepSpeed: DeepSpeed's own Muon (`MuonWithAuxAdam`) over the trainer's groups.

ZeRO hands a client optimizer flat partitions, not matrices, so the trainer's Muon cannot run
there; DeepSpeed 0.19 orthogonalizes each whole matrix inside its ZeRO optimizers instead
(stage 1/2: when it builds a rank's gradient partition, gathering the matrix's pieces; stage 3:
per sub-group) and `MuonWithAuxAdam` applies the result. This module gives it the trainer's
parameter groups, each parameter tagged `use_muon` by the trainer's roles (hidden matrices;
embeddings, head, router, norms and `optim.muon_exclude` stay on AdamW), and the trainer's
update scale.

Equal to the trainer's Muon (tested): momentum (B <- mu B + (1 - mu) G, Nesterov U = (1 - mu) G
+ mu B), 5 quintic Newton-Schulz steps (3.4445, -4.7750, 2.0315) in bf16, the update scale
(`optim.muon_scaling`: DeepSpeed's own is "spectral", sqrt(max(1, out / in)); "match_adamw"
is put in its place), decoupled weight decay, the AdamW groups (lr, betas, eps, decay by role).
Different (refused at start, naming the setting): gradient clipping under ZeRO 1-3 (DeepSpeed
clips the orthogonalized update with the other gradients, which shrinks Muon's step by the norm
of all updates; ZeRO-0 clips the gradients as the trainer does), polar_express coefficients,
ns_steps other than 5, no Nesterov, split matrices (`optim.muon_split` with fused projections,
e.g. MLA's), expert stacks, CPU optimizer offload.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from model.errors import ConfigError

MUON_OPTIMIZERS = ("muon", "muonclip")


def muon_problems(
    client: torch.optim.Optimizer, stage: int, grad_clip: float, offload: str
) -> list[str]:
    """What DeepSpeed's Muon cannot do the way the trainer's does (empty: it can)."""
    problems = []
    if stage > 0 and grad_clip > 0:
        problems.append(
            f"trainer.grad_clip={grad_clip} under ZeRO-{stage} with Muon: DeepSpeed 0.19 clips "
            "Muon's orthogonalized update together with the gradients, which shrinks Muon's step "
            "by the norm of all updates; set trainer.grad_clip=0, or zero_stage=0"
        )
    if offload != "none":
        problems.append("parallel.deepspeed.offload_optimizer with Muon is not wired in")
    if getattr(client, "blocks", None):
        problems.append(
            "optim.muon_split splits fused matrices of this model, which DeepSpeed's Muon "
            "orthogonalizes whole: set optim.muon_split=none"
        )
    muon_groups = [g for g in client.param_groups if g.get("algorithm") == "muon"]
    for group in muon_groups[:1]:
        if group["ns_schedule"] != "quintic":
            problems.append(f"optim.ns_schedule={group['ns_schedule']}: DeepSpeed's is quintic")
        if group["ns_steps"] != 5:
            problems.append(f"optim.ns_steps={group['ns_steps']}: DeepSpeed's Muon takes 5")
        if not group["nesterov"]:
            problems.append("optim.muon_nesterov=false: DeepSpeed's Muon is Nesterov's")
    if any(p.ndim != 2 for g in muon_groups for p in g["params"]):
        problems.append("Muon on expert stacks (3-D) under DeepSpeed is not wired in")
    if any(g.get("algorithm") not in ("muon", "adamw") for g in client.param_groups):
        problems.append("only Muon and AdamW groups run under DeepSpeed's Muon")
    return problems


def deepspeed_muon(client: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """DeepSpeed's MuonWithAuxAdam over the client's groups (their names, peak lrs, decay and
    Muon settings kept, so the trainer's schedule and config keep working on them)."""
    from deepspeed.runtime.zero.muon import original_muon
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    groups: list[dict[str, Any]] = []
    scalings = set()
    for group in client.param_groups:
        use_muon = group["algorithm"] == "muon"
        for param in group["params"]:
            param.use_muon = use_muon  # DeepSpeed's ZeRO optimizers read the tag
        settings = {key: value for key, value in group.items() if key != "params"}
        settings.update(use_muon=use_muon)
        if use_muon:
            settings["ns_method"] = "standard"  # the quintic in bf16 (its "gram" runs in fp16)
            scalings.add(group["scaling"])
        groups.append({"params": list(group["params"]), **settings})
    for scaling in scalings:  # one per run (optim.muon_scaling)
        original_muon._aspect_ratio_scale = _update_scale(scaling)
    return MuonWithAuxAdam(groups, adam_optimizer=None, adam_w_mode=True)


def _update_scale(scaling: str):
    """optim.matrix_blocks.update_scale as DeepSpeed's `_aspect_ratio_scale(rows, cols)` (rows:
    fan_out of an nn.Linear weight), written without max() so that torch.compile's symbolic
    sizes stay exact (DeepSpeed's own note on that function)."""
    if scaling == "match_adamw":
        return lambda rows, cols: 0.2 * math.sqrt(rows if rows > cols else cols)
    if scaling == "spectral":
        return lambda rows, cols: math.sqrt(rows / cols) if rows > cols else 1.0
    raise ConfigError(f"optim.muon_scaling={scaling!r} has no DeepSpeed equivalent")
