"""Rank functions of the pipeline-parallel tests (imported by the forked gloo ranks)."""

from __future__ import annotations

from typing import Any

import torch

from model.config import ModelConfig
from tests.parallel.workers import (
    GLOBAL_BATCH,
    engine_for,
    global_batches,
    local_batch,
    small_model,
    train,
)

STEPS = 3
MB = 4  # micro-batches per step (the schedules' accumulation; 2 rows each on one data rank)
FOUR = {"n_layers": 4}
UNTIED = FOUR | {"tie_embeddings": False}  # (no shared embedding: a head of its own)
# MoE on both stages, with the balance terms that reach the stage's backward through its output
MOE = FOUR | {"moe.seq_aux_loss_coef": 0.01, "moe.z_loss_coef": 0.001}

# name: (model, optimizer, QK-clip tau)
CASES: dict[str, tuple[ModelConfig, str, float]] = {
    "tiny": (small_model("tiny", **FOUR), "adamw", 0.0),
    "untied": (small_model("tiny", **UNTIED), "adamw", 0.0),
    "moe": (small_model("tiny_moe", **MOE), "adamw", 0.0),
    "moe_untied": (small_model("tiny_moe", **MOE, tie_embeddings=False), "adamw", 0.0),
    "mla": (small_model("tiny_mla", **FOUR), "adamw", 0.0),
    "gdn": (small_model("tiny_hybrid", **FOUR), "adamw", 0.0),
    "mhc": (small_model("tiny_mhc", **FOUR), "adamw", 0.0),
    "attnres": (small_model("tiny_attnres", **FOUR), "adamw", 0.0),
    "attnres_untied": (small_model("tiny_attnres", **UNTIED), "adamw", 0.0),
    "attnres_block": (small_model("tiny_attnres", **FOUR, **{"attnres.block_layers": 2}), "adamw", 0.0),
    "engram": (small_model("tiny_engram", **FOUR), "adamw", 0.0),
    "mtp": (small_model("tiny", **FOUR, **{"mtp.depth": 1}), "adamw", 0.0),
    "muonclip": (small_model("tiny", **FOUR), "muonclip", 5.0),
    # the Switch balance loss is per data rank's tokens (as without a pipeline): left out where
    # data ranks take part and the run is compared with one process
    "moe_exact": (small_model("tiny_moe", **MOE, **{"moe.aux_loss_coef": 0.0}), "adamw", 0.0),
    "tiny8": (small_model("tiny", n_layers=8, tie_embeddings=False), "adamw", 0.0),
}  # fmt: skip


def run_case(rank: int, name: str, layout: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    model_cfg, optimizer, tau = CASES[name]
    return train(rank, model_cfg, layout, STEPS, MB, optimizer_name=optimizer, qk_clip_tau=tau, **kwargs)  # fmt: skip


def run_cases(rank: int, runs: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Every (case, layout) of `runs` on this rank, in one process group."""
    return [run_case(rank, name, layout) for name, layout in runs]


def evaluation(rank: int, name: str, layout: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The validation loss and each target's log-probability of the first global batch's rows
    of this rank, through the engine (the pipeline's stages in order)."""
    model_cfg, _, _ = CASES[name]
    engine = engine_for(model_cfg, layout, micro_batches=MB)
    batch = local_batch(global_batches(1, model_cfg.vocab_size)[0], 1, layout.get("pp", 1))
    with engine.evaluating():
        loss = engine.evaluation_loss(batch.inputs, batch.targets, None)
        log_probs = engine.evaluation_log_probs(batch.inputs, batch.targets)
    return {"loss": loss, "log_probs": log_probs, "rows": GLOBAL_BATCH}


def generated(rank: int, name: str, layout: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Greedy and sampled continuations (8 tokens) of two prompts through the engine's
    full_weights (a pipeline's stages in order, each keeping its blocks' generation state)."""
    from model.generate import generate

    model_cfg, _, _ = CASES[name]
    engine = engine_for(model_cfg, layout, micro_batches=MB)
    prompt = global_batches(1, model_cfg.vocab_size)[0][:2, :5]
    with engine.evaluating(), engine.full_weights() as model:
        greedy = generate(model, prompt, 8, temperature=0.0)
        gen = torch.Generator().manual_seed(7)
        sampled = generate(model, prompt, 8, temperature=0.8, top_k=50, generator=gen)
    return {"greedy": greedy, "sampled": sampled}


def skipped_step(rank: int, layout: dict[str, Any]) -> dict[str, Any]:
    """A step whose gradient is not finite on the last stage's rank only: the global norm says so
    on every rank, and no rank updates its weights."""
    from parallel.engine import plain_loss
    from tests.parallel.workers import full_state

    engine = engine_for(CASES["tiny"][0], layout, micro_batches=MB)
    before = full_state(engine.model)
    batch = local_batch(global_batches(1, CASES["tiny"][0].vocab_size)[0], 1, layout["pp"])
    engine.forward_backward_step(batch.inputs, batch.targets, None, MB, plain_loss)
    if rank == 1:
        param = next(p for p in engine.model.parameters() if p.grad is not None)
        grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
        grad.view(-1)[0] = float("nan")
    norm, applied = engine.finish_step(1.0, True)
    engine.zero_grad()
    after = full_state(engine.model)
    unchanged = all(torch.equal(after[k], v) for k, v in before.items())
    return {"norm": norm, "applied": applied, "unchanged": unchanged}


def bf16_losses(rank: int, name: str, layout: dict[str, Any]) -> list[float]:
    """Two bf16 steps (FSDP2's bf16 compute; one process: autocast): the losses."""
    model_cfg, _, _ = CASES[name]
    return train(rank, model_cfg, layout, 2, MB, precision="bf16")["losses"]
