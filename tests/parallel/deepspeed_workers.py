"""What each rank runs in the DeepSpeed engine tests: tests/parallel/workers.py's training
(the same model, data and steps) through `parallel.engine=deepspeed`, with the weights gathered
whole at the end (ZeRO-3 partitions them)."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from model.config import ModelConfig
from optim.config import OptimConfig
from parallel.config import DeepSpeedConfig, ParallelConfig
from parallel.mesh import ParallelDims
from tests.parallel.workers import GLOBAL_BATCH, global_batches, local_batch, world
from trainer.build import build_training_engine
from trainer.config import TrainerConfig
from trainer.hooks import start_hooks
from trainer.step import LossTracker, StepSettings, train_step


def deepspeed_engine(
    model_cfg: ModelConfig,
    zero_stage: int,
    precision: str = "fp32",
    micro_batches: int = 1,
    optimizer_name: str = "adamw",
    grad_clip: float = 1.0,
    ep: int = 1,
    **ds: Any,
):
    _, size = world()
    if zero_stage == 3 and "config" not in ds:
        ds["config"] = partition_everything()
    pcfg = ParallelConfig(
        engine="deepspeed", ep=ep, deepspeed=DeepSpeedConfig(zero_stage=zero_stage, **ds)
    )
    micro = GLOBAL_BATCH // size // micro_batches
    tcfg = TrainerConfig(
        precision=precision,
        batch_size=GLOBAL_BATCH,
        micro_batch_size=micro,
        grad_clip=grad_clip,
        compile="false",
    )
    optim_cfg = OptimConfig(name=optimizer_name, lr=3e-3, warmup_steps=0, schedule="constant")
    dims = ParallelDims.resolve(pcfg, size)
    return build_training_engine(model_cfg, tcfg, pcfg, optim_cfg, dims, torch.device("cpu"), 0)


def muon_momentum(engine) -> float:
    """The sum of |Muon's momentum| this rank holds (its ZeRO partitions, or whole buffers)."""
    inner = getattr(engine.ds.optimizer, "optimizer", engine.ds.optimizer)
    buffers = [s["momentum_buffer"] for s in inner.state.values() if "momentum_buffer" in s]
    return float(sum(b.abs().sum() for b in buffers))


def partition_everything() -> str:
    """A DeepSpeed JSON that makes ZeRO-3 partition every weight: by default it keeps weights
    under 1e5 elements whole on every rank (stage3_param_persistence_threshold), which is all
    of a test model's."""
    path = Path(tempfile.gettempdir()) / f"ds_partition_everything_{os.getpid()}.json"
    path.write_text(json.dumps({"zero_optimization": {"stage3_param_persistence_threshold": 0}}))
    return str(path)


def train_deepspeed(
    rank: int,
    model_cfg: ModelConfig,
    zero_stage: int,
    steps: int,
    micro_batches: int = 1,
    precision: str = "fp32",
    bad_loss_at: int = -1,
    options: dict[str, Any] | None = None,
    optimizer_name: str = "adamw",
    grad_clip: float = 1.0,
    qk_clip_tau: float = 0.0,
    ep: int = 1,
) -> dict[str, Any]:
    """Losses, norms, whether each step applied, the step statistics (QK-clip's) and the final
    whole weights; `bad_loss_at`: the loop judges that step's loss bad (a spike), so the engine
    must drop its gradients; `options`: more parallel.deepspeed settings."""
    engine = deepspeed_engine(
        model_cfg,
        zero_stage,
        precision,
        micro_batches,
        optimizer_name,
        grad_clip,
        ep,
        **(options or {}),
    )
    hooks = start_hooks(engine, qk_clip_tau, None)  # MoE balancing, QK-clip, ...
    settings = StepSettings(micro_batches=micro_batches, grad_clip=grad_clip)
    tracker = LossTracker(0.0)
    losses, norms, applied, stats, momenta = [], [], [], [], []
    for step, tokens in enumerate(global_batches(steps, model_cfg.vocab_size)):
        if step == bad_loss_at:
            tracker.spike = lambda loss: True  # the loop's verdict; the engine must drop it
        result = train_step(engine, local_batch(tokens), settings, tracker, hooks)
        tracker.spike = LossTracker.spike.__get__(tracker)
        losses.append(result.loss)
        norms.append(result.grad_norm)
        applied.append(not result.skipped)
        stats.append(result.metrics)
        momenta.append(muon_momentum(engine))
    final = whole_weights(engine)
    return {
        "losses": losses,
        "norms": [n if math.isfinite(n) else None for n in norms],
        "applied": applied,
        "stats": stats,
        "momentum": momenta,
        "final": final,
        "optimizer": type(engine.optimizer).__name__,
    }


def train_and_save(
    rank: int,
    model_cfg: ModelConfig,
    zero_stage: int,
    steps: int,
    save_after: int,
    where: str,
    optimizer_name: str = "adamw",
    ep: int = 1,
    precision: str = "fp32",
) -> dict[str, Any]:
    """The losses of `steps` steps, the whole weights saved (and the persistent buffers) and
    final, DeepSpeed's checkpoint written after `save_after` of them into `where` (a step
    directory); Muon without clipping."""
    clip = 0.0 if optimizer_name == "muon" else 1.0
    engine = deepspeed_engine(
        model_cfg, zero_stage, precision, optimizer_name=optimizer_name, grad_clip=clip, ep=ep
    )
    settings, tracker = StepSettings(micro_batches=1, grad_clip=clip), LossTracker(0.0)
    hooks = start_hooks(engine, 0.0, None)
    losses, saved, buffers = [], {}, {}
    for step, tokens in enumerate(global_batches(steps, model_cfg.vocab_size)):
        losses.append(train_step(engine, local_batch(tokens), settings, tracker, hooks).loss)
        if step + 1 == save_after:
            engine.write_checkpoint(Path(where))
            saved = whole_weights(engine)
            params = dict(engine.model.named_parameters())
            buffers = {
                n: t.clone() for n, t in engine.model.state_dict().items() if n not in params
            }
    return {"losses": losses, "final": whole_weights(engine), "saved": saved, "buffers": buffers}


def whole_weights(engine) -> dict[str, torch.Tensor]:
    """Every weight whole: ZeRO-3's gathered, expert weights (this rank's experts under
    parallel.ep) concatenated over the expert-parallel group, Engram's tables."""
    with engine.full_weights() as model:
        whole = {name: p.detach().float().clone() for name, p in model.named_parameters()}
    if engine.tables is not None:  # Engram's, outside ZeRO and the module tree
        whole |= {n: w.detach().clone() for n, w in engine.tables.named_weights().items()}
    for name, param in engine.model.named_parameters():
        if getattr(param, "allreduce", True) is False:
            from deepspeed.utils import groups

            group = groups._get_expert_parallel_group(param.group_name)
            parts = [torch.empty_like(whole[name]) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, whole[name], group=group)
            whole[name] = torch.cat(parts)
    return whole


def resume_and_train(
    rank: int,
    model_cfg: ModelConfig,
    zero_stage: int,
    steps: int,
    start: int,
    where: str,
    ep: int = 1,
    precision: str = "fp32",
) -> dict[str, Any]:
    """The losses of steps start+1 .. steps after loading the checkpoint in `where`, the final
    whole weights and each optimizer group's weight decay."""
    engine = deepspeed_engine(model_cfg, zero_stage, precision, ep=ep)
    assert engine.checkpoint_conflict(Path(where)) is None
    engine.read_checkpoint(Path(where))
    settings, tracker = StepSettings(micro_batches=1, grad_clip=1.0), LossTracker(0.0)
    hooks = start_hooks(engine, 0.0, None)
    batches = global_batches(steps, model_cfg.vocab_size)[start:]
    losses = [train_step(engine, local_batch(t), settings, tracker, hooks).loss for t in batches]
    decay = [group["weight_decay"] for group in engine.optimizer.param_groups]
    return {"losses": losses, "final": whole_weights(engine), "decay": decay}


def load_refusal(rank: int, model_cfg: ModelConfig, zero_stage: int, where: str) -> str:
    """What DeepSpeed's own load of the checkpoint in `where` raised ("" if nothing), called
    directly: without the trainer's vetting of the files in front of it."""
    engine = deepspeed_engine(model_cfg, zero_stage)
    try:
        engine.read_checkpoint(Path(where))
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return ""


def conflict_with(
    rank: int,
    model_cfg: ModelConfig,
    zero_stage: int,
    where: str,
    optimizer_name: str = "muon",
    ep: int = 1,
) -> str | None:
    """Why an engine on this many ranks cannot load the checkpoint in `where`."""
    clip = 0.0 if optimizer_name == "muon" else 1.0
    engine = deepspeed_engine(
        model_cfg, zero_stage, optimizer_name=optimizer_name, grad_clip=clip, ep=ep
    )
    return engine.checkpoint_conflict(Path(where))


def masters_after_init(rank: int, model_cfg: ModelConfig, zero_stage: int) -> float:
    """bf16_master started from whole fp32 weights (init_from): the largest difference between
    DeepSpeed's fp32 masters and those weights."""
    from deepspeed.utils import safe_get_full_fp32_param

    from model.transformer import build_model

    _, size = world()
    weights = build_model(model_cfg, device="cpu", seed=7).state_dict()
    ds = {"config": partition_everything()} if zero_stage == 3 else {}
    pcfg = ParallelConfig(
        engine="deepspeed", deepspeed=DeepSpeedConfig(zero_stage=zero_stage, **ds)
    )
    # one sequence per rank: the batch divides over 3 ranks too (only the start is measured)
    tcfg = TrainerConfig(precision="bf16_master", batch_size=size, compile="false")
    engine = build_training_engine(
        model_cfg, tcfg, pcfg, OptimConfig(), ParallelDims.resolve(pcfg, size),
        torch.device("cpu"), 0, lambda: [weights],
    )  # fmt: skip
    return max(
        float((safe_get_full_fp32_param(p) - weights[name]).abs().max())
        for name, p in engine.model.named_parameters()
    )


def muon_beta_after_schedule(rank: int, model_cfg: ModelConfig) -> float:
    """ZeRO-3 Muon's momentum after the trainer's schedule set 0.5 in the groups and a step."""
    engine = deepspeed_engine(model_cfg, 3, optimizer_name="muon", grad_clip=0.0)
    for group in engine.optimizer.param_groups:
        if group.get("algorithm") == "muon":
            group["momentum"] = 0.5  # what optim.schedules sets during momentum warmup
    tokens = global_batches(1, model_cfg.vocab_size)[0]
    hooks = start_hooks(engine, 0.0, None)
    train_step(engine, local_batch(tokens), StepSettings(grad_clip=0.0), LossTracker(0.0), hooks)
    return engine.ds.optimizer.muon_beta


def deepspeed_scored_log_probs(rank: int, model_cfg: ModelConfig, zero_stage: int) -> torch.Tensor:
    """engine.evaluation_log_probs of this rank's rows under DeepSpeed (workers.scored_log_probs'
    batch and ignored context)."""
    engine = deepspeed_engine(model_cfg, zero_stage)
    batch = local_batch(global_batches(1, model_cfg.vocab_size)[0])
    targets = batch.targets.clone()
    targets[:, : targets.shape[1] // 2] = -100
    with engine.evaluating():
        return engine.evaluation_log_probs(batch.inputs, targets, None)


def deepspeed_downstream_scores(
    rank: int, model_cfg: ModelConfig, zero_stage: int, tasks: list, batch_tokens: int
) -> tuple:
    """workers.downstream_scores through the DeepSpeed engine."""
    from tests.parallel.workers import score_tasks

    engine = deepspeed_engine(model_cfg, zero_stage)
    return score_tasks(engine, tasks, batch_tokens, model_cfg.vocab_size - 1)
