"""Rank functions of the tensor-parallel tests (imported by the forked gloo ranks)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from model.presets import load_preset
from model.transformer import build_model

VOCAB, B, T = 128, 2, 16


def batch(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (B, T + 1), generator=g)
    targets = tokens[:, 1:].clone()
    targets[0, :4] = -100  # some ignored targets
    return tokens[:, :-1], targets


def whole(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.full_tensor() if isinstance(t, DTensor) else t


def tp_forward_backward(rank: int, preset: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """One fp32 forward + backward of a seeded model, split over every rank as one tp group (or
    whole, without a process group): loss, whole gradients, scoring log-probs, logits."""
    from parallel.tensor_parallel import apply_tensor_parallel, tp_mesh_of

    cfg = load_preset(preset, {"vocab_size": VOCAB, "max_seq_len": 64} | overrides)
    model = build_model(cfg, seed=0)
    replicated: list[str] = []
    if dist.is_initialized():
        world = dist.get_world_size()
        replicated = apply_tensor_parallel(model, tp_mesh_of(world, world, "cpu"))
    inputs, targets = batch()
    loss = model(inputs, targets)
    loss.backward()
    grads = {n: whole(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    with torch.no_grad():
        log_probs = model(inputs, targets, per_token=True)
        logits = model(inputs)
    return {
        "loss": loss.detach(),
        "grads": grads,
        "log_probs": log_probs,
        "logits": logits,
        "replicated": replicated,
        "sharded": sorted(n for n, p in model.named_parameters() if isinstance(p, DTensor)),
    }
