"""`train(cfg, run_dir)`: build every part from the root config, resume if asked, run the loop.

The composition root: the only code that reads the whole config. Building is split into small
functions (trainer.build) so that each component receives only its own settings.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import uuid
from pathlib import Path

import torch
from omegaconf import OmegaConf

from model.accounting import param_counts, training_flops_per_token
from model.config import ModelConfig
from model.transformer import Transformer
from optim.builder import apply_config, build_optimizer
from optim.qk_clip import enable_qk_clip
from parallel.mesh import ParallelDims
from trainer.build import (
    build_loader,
    build_parallel_model,
    check_cross_fields,
    check_expert_parallel,
    dataset_manifest,
    resolve_model_config,
)
from trainer.checkpoint import Checkpointer, resume, set_aside
from trainer.collective import from_main
from trainer.config import RootConfig
from trainer.distributed import is_collective_timeout
from trainer.evaluate import describe_evaluation
from trainer.fingerprint import Fingerprint
from trainer.loop import Training
from trainer.metrics import MetricsFile
from trainer.mfu import device_peak
from trainer.precision import MasterWeights, autocast_factory, compute_dtype
from trainer.runtime import Ranks, describe_environment, pick_device, seed_everything, set_rng_state
from trainer.signals import ParentWatch, StopFlag, under_torchrun
from trainer.step import LossTracker
from trainer.wandb_run import WandbRun

log = logging.getLogger("trainer")


def build_training(cfg: RootConfig, run_dir: Path, ranks: Ranks) -> Training:
    tcfg = cfg.trainer
    # every check that needs no data first: a bad setting fails before any file is touched
    dims = ParallelDims.resolve(cfg.parallel, ranks.world_size)
    check_expert_parallel(cfg.model, dims, cfg.parallel.activation_checkpoint)
    check_cross_fields(cfg.model, cfg.data, tcfg, ranks.world_size)
    run_dir.mkdir(parents=True, exist_ok=True)
    if tcfg.threads:
        torch.set_num_threads(tcfg.threads)
    device = pick_device(tcfg.device, ranks.local_rank)
    manifest = dataset_manifest(cfg.data, ranks.is_main)
    model_cfg = resolve_model_config(cfg.model, manifest)
    micro_batches = check_cross_fields(model_cfg, cfg.data, tcfg, ranks.world_size)
    model, master, optimizer = build_state(cfg, model_cfg, dims, device)
    loader = build_loader(
        cfg.data, manifest, tcfg.batch_size, ranks.rank, ranks.world_size, cfg.seed
    )
    loader.manifest.check_tokenizer(manifest.tokenizer)
    peak, peak_source = device_peak(device, compute_dtype(tcfg.precision), tcfg.peak_flops)
    flops = training_flops_per_token(model, cfg.data.seq_len).total
    counts = param_counts(model)
    log.info("%s; device %s; %s", describe_environment(), device, dims.describe())
    log.info(
        "model: %s parameters, %.3g training FLOPs/token at seq_len %d; vocab %d (tokenizer %s)",
        f"{counts.total:,}",
        flops,
        cfg.data.seq_len,
        model_cfg.vocab_size,
        manifest.tokenizer.short(),
    )
    log.info("MFU peak: %.3g FLOP/s per device (%s)", peak, peak_source)
    log.info(
        "data: %s, %d training windows of %d tokens; %d micro-batch(es) of %d per step",
        manifest.root,
        loader.windows,
        cfg.data.seq_len,
        micro_batches,
        tcfg.batch_size // ranks.world_size // micro_batches,
    )
    config_yaml = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    training = Training(
        cfg=cfg,
        run_dir=run_dir,
        ranks=ranks,
        device=device,
        model=model,
        optimizer=optimizer,
        loader=loader,
        autocast=autocast_factory(tcfg.precision, device),
        micro_batches=micro_batches,
        flops_per_token=flops,
        peak_flops=peak,
        metrics=MetricsFile(run_dir / "metrics.jsonl", ranks.is_main),
        wandb=None,  # type: ignore[arg-type]  (set below, once the resumed run id is known)
        stop=StopFlag(),
        tracker=LossTracker(tcfg.spike_factor),
        config_yaml=config_yaml,
        checkpointer=Checkpointer(
            run_dir / "checkpoints",
            ranks.rank,
            cfg.checkpoint.keep,
            cfg.checkpoint.async_save,
            fingerprint=Fingerprint.of(model_cfg, cfg.optim),
            timeout_s=cfg.parallel.timeout_s,
        ),
        master=master,
        model_cfg=model_cfg,
        dims=dims,
    )
    training.eval_coverage = describe_evaluation(loader)
    wandb_id = _resume_into(training, cfg.resume)
    training.wandb = WandbRun(
        cfg.logging,
        run_dir,
        OmegaConf.to_container(OmegaConf.structured(cfg)),
        wandb_id,
        ranks.is_main,
    )
    return training


def build_state(
    cfg: RootConfig, model_cfg: ModelConfig, dims: ParallelDims, device: torch.device
) -> tuple[Transformer, MasterWeights | None, torch.optim.Optimizer]:
    """The model (sharded when there are several ranks), its fp32 master copy if any, and the
    optimizer, all as a fresh run starts them (seeded by `cfg.seed`)."""
    seed_everything(cfg.seed)
    model, master = build_parallel_model(
        model_cfg, cfg.trainer, cfg.parallel, dims, device, cfg.seed
    )
    optimizer = build_optimizer(cfg.optim, master.master if master else model)
    if cfg.optim.qk_clip_tau > 0:
        enable_qk_clip(model)  # attention layers record their per-head max logits
    return model, master, optimizer


def _resume_into(training: Training, resume_from: str) -> str | None:
    checkpointer = training.checkpointer
    restored, failed = resume(
        resume_from,
        checkpointer.root,
        training.state_model,
        training.optimizer,
        training.ranks.rank,
        checkpointer.fingerprint,
        training.cfg.checkpoint.verify,
    )
    if restored is None:
        if failed:  # the failed loads may have left weights or moments half-read
            kept = set_aside(failed, training.run_dir, training.ranks.is_main)
            log.warning(
                "no checkpoint could be loaded: they were moved to %s (nothing deleted), and the "
                "run starts from scratch, freshly initialized",
                kept,
            )
            _start_over(training)
        elif resume_from == "auto":
            log.info("no checkpoint in %s: starting from scratch", checkpointer.root)
        checkpointer.run_id = from_main(uuid.uuid4().hex[:12])
        training.metrics.truncate_after(-1)  # rows of an earlier attempt that saved nothing
        return None
    # the config given now wins over the saved hyperparameters
    apply_config(training.optimizer, training.cfg.optim)
    if training.master is not None:
        training.master.master_to_model(buffers=True)
    extra = restored.extra
    checkpointer.run_id = extra.get("run_id") or from_main(uuid.uuid4().hex[:12])
    if restored.path.resolve().parent == checkpointer.root.resolve():  # this run's own
        checkpointer.last_committed = restored.path
        training.restored_step = extra["step"]
    training.step, training.tokens = extra["step"], extra["tokens"]
    training.bad_streak, training.skipped_total = extra["bad_streak"], extra["skipped_total"]
    training.tracker.load_state_dict(extra["loss_tracker"])
    training.loader.load_state_dict(extra["loader"])
    set_rng_state(extra["rng"])
    training.metrics.truncate_after(training.step)
    log.info(
        "resumed from %s at step %d (%d tokens)", restored.path, training.step, training.tokens
    )
    return extra.get("wandb_id")


def _start_over(training: Training) -> None:
    """Replace the model, master copy and optimizer by freshly initialized ones."""
    training.model = training.master = training.optimizer = None  # type: ignore[assignment]
    gc.collect()
    training.model, training.master, training.optimizer = build_state(
        training.cfg, training.model_cfg, training.dims, training.device
    )


def train(cfg: RootConfig, run_dir: Path, ranks: Ranks) -> int:
    if job := os.environ.get("SLURM_JOB_ID"):
        restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
        log.info("SLURM job %s (restart count %s) on %s", job, restarts, socket.gethostname())
    training = None
    try:
        training = build_training(cfg, run_dir, ranks)
        training.stop.install()
        if under_torchrun():  # the agent's death must not leave this worker training
            ParentWatch(training.stop, cfg.trainer.orphan_grace_s).start()
        return training.run()
    except RuntimeError as err:
        if not is_collective_timeout(err):
            raise
        phase = training.phase if training is not None else "start-up"
        log.error(
            "rank %d: a collective in %s waited more than %g s (parallel.timeout_s) for the other "
            "ranks and gave up: one of them is hung, stopped or dead (its logs/rank<N>.log shows "
            "the last step it reached). Nothing was saved; resume=auto continues from the last "
            "checkpoint",
            ranks.rank,
            phase,
            cfg.parallel.timeout_s,
        )
        return 1
