"""`train(cfg, run_dir)`: build every part from the root config, resume if asked, run the loop.

The composition root: the only code that reads the whole config. Building is split into small
functions (trainer.build) so that each component receives only its own settings.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from omegaconf import OmegaConf

from data.loader import TokenLoader
from data.token_compression import canonical_ids, save_or_check
from model.accounting import ParamCounts, param_counts, training_flops_per_token
from model.config import ModelConfig
from model.mixers.attention_backend import check_training_device
from model.training_hooks import TrainingHook
from model.transformer import build_model
from optim.builder import apply_config
from optim.schedules import Schedule
from parallel.collective import from_main
from parallel.engine import TrainingEngine
from parallel.mesh import ParallelDims
from parallel.precision import compute_dtype, native_bf16, resolve_precision
from trainer.build import (
    EngineChoices,
    build_loader,
    check_model_shape,
    check_start,
    dataset_manifest,
    resolve_model_config,
    start_engine,
)
from trainer.checkpoint.fingerprint import Fingerprint
from trainer.checkpoint.load import resume, set_aside
from trainer.checkpoint.save import Checkpointer
from trainer.checkpoint.weights import init_weights_reader, resumes_its_own
from trainer.config import (
    COMPILE_MIN_STEPS,
    RootConfig,
    TrainerConfig,
    compiles,
    cpp_compiler,
)
from trainer.cpu_malloc import keep_freed_memory
from trainer.distributed import is_collective_timeout
from trainer.downstream.evaluator import DownstreamEvaluator
from trainer.evaluate import data_prompt, describe_evaluation
from trainer.hf_init import hf_model_config, hf_weights_reader, is_hf
from trainer.hooks import start_hooks
from trainer.loop import Training
from trainer.metrics import MetricsFile
from trainer.mfu import device_peak
from trainer.run_settings import BatchPlan, LoopSettings
from trainer.runtime import Ranks, describe_environment, pick_device, seed_everything, set_rng_state
from trainer.signals import ParentWatch, StopFlag, under_torchrun
from trainer.step import LossTracker, StepSettings
from trainer.wandb_run import WandbRun

log = logging.getLogger("trainer")


def build_training(cfg: RootConfig, run_dir: Path, ranks: Ranks) -> Training:
    tcfg = cfg.trainer
    # every check that needs no data first: a bad setting fails before any file is touched
    dims, plan = check_start(cfg, ranks.world_size)
    hf = is_hf(cfg.init_from)  # the model comes from a Hugging Face checkpoint (trainer/hf_init.py)
    run_dir.mkdir(parents=True, exist_ok=True)
    if tcfg.threads:
        torch.set_num_threads(tcfg.threads)
    device = pick_device(tcfg.device, ranks.local_rank)
    choices = EngineChoices(
        choose_precision(tcfg.precision, device),
        compiles(tcfg),
        tcfg.grad_clip,
        plan,
        cfg.data.seq_len,
        tcfg.float8,
    )
    if device.type == "cpu" and tcfg.cpu_malloc == "keep":
        log.info("CPU allocator: %s", keep_freed_memory())
    manifest = dataset_manifest(cfg.data, ranks.is_main)
    if hf:
        model_cfg = hf_model_config(cfg.init_from, manifest, explicit_overrides())
        check_model_shape(model_cfg, cfg.data, dims)  # known only now: from the checkpoint's config
    else:
        model_cfg = resolve_model_config(cfg.model, manifest)
    check_training_device(model_cfg.attention.backend, model_cfg.kernels, device.type)
    loader = build_loader(  # the ranks of a tp group read the same rows
        cfg.data, manifest, plan.global_batch, dims.dp_rank(ranks.rank), dims.dp_ranks, cfg.seed
    )
    loader.manifest.check_tokenizer(manifest.tokenizer)
    canonical = token_compression(model_cfg, loader, run_dir)  # checked; written once started
    reader = hf_weights_reader if hf else init_weights_reader
    initial = reader(cfg.init_from, model_cfg)  # also after failed resumes
    resuming = from_main(resumes_its_own(cfg.resume, run_dir))  # listings may differ per node
    if initial is not None and resuming:
        log.info("init_from=%s is not used: the run resumes its checkpoint", cfg.init_from)
    fresh = partial(build_state, cfg, model_cfg, dims, device, choices, canonical)
    engine, hooks = fresh(None if resuming else initial)
    dtype = compute_dtype(choices.precision)  # rank 0 measures alone: no rank slows another's
    peak, peak_source = from_main(
        device_peak(device, dtype, tcfg.peak_flops) if ranks.is_main else None
    )  # one value for every rank (MFU is averaged over them)
    # counted on a meta build of the config: an engine's own modules may hold shards (ZeRO-3's
    # partitions have no elements, expert parallelism keeps a rank's experts)
    whole = build_model(model_cfg, device="meta")
    flops = training_flops_per_token(whole, cfg.data.seq_len).total
    log.info("%s; device %s; %s", describe_environment(), device, dims.describe())
    _log_model_and_data(cfg, param_counts(whole), model_cfg, flops, loader, plan, choices.compile)
    log.info("MFU peak: %.3g FLOP/s per device (%s)", peak, peak_source)
    checkpointer = Checkpointer(
        run_dir / "checkpoints",
        ranks.rank,
        cfg.checkpoint.keep,
        cfg.checkpoint.async_save,
        fingerprint=Fingerprint.of(model_cfg, cfg.optim),
        timeout_s=cfg.parallel.timeout_s,
    )
    metrics = MetricsFile(run_dir / "metrics.jsonl", ranks.is_main)
    tracker = LossTracker(tcfg.spike_factor)
    coverage = describe_evaluation(loader)
    downstream = DownstreamEvaluator.build(
        cfg.eval.downstream,
        loader.tokenizer,
        cfg.data.seq_len,
        plan.micro_batch_size * cfg.data.seq_len,
    )
    if downstream is not None:
        # FlexAttention compiles once per shape (model/mixers/attention_backend.py): few shapes
        downstream.fixed_shapes(model_cfg.attention.backend == "flex")
        log.info("%s", downstream.describe())
    restart = Restart(engine=engine, hooks=hooks)
    del engine, hooks  # the restart holds them (and drops them if they must be rebuilt)
    restart = _resume(cfg, run_dir, ranks, checkpointer, restart, loader, tracker, metrics)
    _fresh_if_needed(restart, partial(fresh, initial))
    if canonical is not None:  # the start is accepted: a refused one writes nothing
        save_or_check(run_dir, loader.tokenizer, canonical.tolist(), write=ranks.is_main)
    recorded = OmegaConf.structured(as_run(cfg, choices.precision))
    wandb = WandbRun(
        cfg.logging, run_dir, OmegaConf.to_container(recorded), restart.wandb_id, ranks.is_main
    )
    settings = StepSettings(
        micro_batches=plan.micro_batches,
        grad_clip=tcfg.grad_clip,
        doc_mask=tcfg.doc_mask,
    )
    return Training(
        loop=loop_settings(cfg, plan, choices.compile),
        run_dir=run_dir,
        ranks=ranks,
        device=device,
        engine=restart.engine,
        model_cfg=model_cfg,
        schedule=Schedule(cfg.optim, tcfg.max_steps),
        settings=settings,
        loader=loader,
        flops_per_token=flops,
        peak_flops=peak,
        metrics=metrics,
        wandb=wandb,
        stop=StopFlag(),
        checkpointer=checkpointer,
        step=restart.step,
        tokens=restart.tokens,
        bad_streak=restart.bad_streak,
        skipped_total=restart.skipped_total,
        tracker=tracker,
        config_yaml=OmegaConf.to_yaml(recorded),
        restored_step=restart.restored_step,
        eval_coverage=coverage,
        sample_prompt=tcfg.sample_prompt or data_prompt(loader),
        hooks=restart.hooks,
        downstream=downstream,
    )


def as_run(cfg: RootConfig, precision: str) -> RootConfig:
    """A copy of `cfg` as the run resolved it (trainer.precision chosen for the device): what
    checkpoints and wandb record; `cfg` itself is never changed."""
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, precision=precision))


def loop_settings(cfg: RootConfig, plan: BatchPlan, compiled: bool) -> LoopSettings:
    """What the training loop reads, resolved once."""
    tcfg = cfg.trainer
    return LoopSettings(
        max_steps=tcfg.max_steps,
        log_every=tcfg.log_every,
        eval_every=tcfg.eval_every,
        sample_tokens=tcfg.sample_tokens,
        checkpoint_every=cfg.checkpoint.every,
        max_bad_steps=tcfg.max_bad_steps,
        requeue=tcfg.requeue,
        fault_step=tcfg.fault_step,
        fault_rank=tcfg.fault_rank,
        compiled=compiled,
        compile_eval=tcfg.compile_eval,
        tokens_per_step=plan.global_batch * cfg.data.seq_len,
        seed=cfg.seed,
        progress=cfg.logging.progress,
    )


def explicit_overrides() -> list[str]:
    """The command line's overrides (Hydra's task overrides; none outside a Hydra run)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def _log_model_and_data(
    cfg: RootConfig,
    counts: ParamCounts,
    model_cfg: ModelConfig,
    flops: float,
    loader: TokenLoader,
    plan: BatchPlan,
    compiled: bool,
) -> None:
    active = f" ({counts.active:,} active per token)" if counts.active != counts.total else ""
    log.info(
        "model: %s parameters%s, %.3g training FLOPs/token at seq_len %d; vocab %d (tokenizer %s)",
        f"{counts.total:,}",
        active,
        flops,
        cfg.data.seq_len,
        model_cfg.vocab_size,
        loader.manifest.tokenizer.short(),
    )
    log.info("layers: %s", model_cfg.layout_summary())
    log.info("optimizer: %s", cfg.optim.describe())
    log.info("torch.compile: %s", compile_summary(cfg.trainer, compiled))
    warn_short_schedule(cfg)
    log.info(
        "data: %s, %d training windows of %d tokens; per step %d micro-batch(es) of %d "
        "sequences on each of %d data-parallel rank(s)",
        loader.manifest.root,
        loader.windows,
        cfg.data.seq_len,
        plan.micro_batches,
        plan.micro_batch_size,
        plan.dp_ranks,
    )


def warn_short_schedule(cfg: RootConfig) -> None:
    """A run shorter than its warmup never reaches optim.lr: said at the start, in one line."""
    warmup, steps = cfg.optim.warmup_steps, cfg.trainer.max_steps
    if warmup > steps:
        log.warning(
            "optim.warmup_steps=%d > trainer.max_steps=%d: the learning rate never reaches "
            "optim.lr=%g (it peaks at %.3g on the last step); lower optim.warmup_steps",
            warmup, steps, cfg.optim.lr, cfg.optim.lr * steps / warmup,
        )  # fmt: skip


def compile_summary(trainer: TrainerConfig, compiled: bool) -> str:
    """The compile decision (`compiled`: trainer.config.compiles) in words, with auto's reason."""
    on = "on, every block and the head + loss" if compiled else "off (eager)"
    if trainer.compile != "auto":
        return f"{on} (trainer.compile={trainer.compile})"
    long_enough = trainer.max_steps >= COMPILE_MIN_STEPS
    comparison = ">=" if long_enough else "<"
    reason = f"{trainer.max_steps} steps {comparison} {COMPILE_MIN_STEPS}"
    if long_enough and not compiled:
        reason += f", but no C++ compiler ({cpp_compiler()}) to compile with"
    return f"{on} (trainer.compile=auto: {reason}; set trainer.compile=true or false to choose)"


def token_compression(
    model_cfg: ModelConfig, loader: TokenLoader, run_dir: Path
) -> torch.Tensor | None:
    """Engram's canonical-id map from the data's tokenizer (checked against the one the run
    directory records, if any); None without Engram layers or with
    model.engram.compress_tokens=false."""
    if not (model_cfg.engram.enabled and model_cfg.engram.compress_tokens):
        return None
    tokenizer = loader.tokenizer
    ids = canonical_ids(tokenizer, model_cfg.vocab_size)
    save_or_check(run_dir, tokenizer, ids, write=False)
    log.info(
        "engram: %d token ids compress to %d canonical ids (%s)",
        len(ids),
        max(ids) + 1,
        run_dir / "token_compression.json",
    )
    return torch.tensor(ids, dtype=torch.long)


def choose_precision(precision: str, device: torch.device) -> str:
    """trainer.precision for this run's device (auto resolved), said in the log; a bf16 request
    on a device without native bf16 matmuls is warned about, not overridden."""
    if precision == "fp32":
        return precision
    native, why = native_bf16(device)
    if precision == "auto":
        resolved = resolve_precision(precision, device)
        log.info("trainer.precision=auto: %s (%s)", resolved, why)
        return resolved
    if not native:
        log.warning(
            "trainer.precision=%s, but %s: its bf16 matmuls run emulated, far slower than fp32 "
            "(78x on an AVX2 CPU); trainer.precision=auto or fp32 picks fp32 here",
            precision,
            why,
        )
    return precision


def build_state(
    cfg: RootConfig,
    model_cfg: ModelConfig,
    dims: ParallelDims,
    device: torch.device,
    choices: EngineChoices,
    canonical: torch.Tensor | None = None,
    initial: Callable[[], dict[str, torch.Tensor]] | None = None,
) -> tuple[TrainingEngine, list[TrainingHook]]:
    """The training engine (model sharded when there are several ranks, its fp32 master copy if
    any, the optimizer), as a fresh run starts it (seeded by `cfg.seed`, or from `initial()`'s
    weights), and its training hooks, started; `choices`: the trainer's, resolved once;
    `canonical`: Engram's token compression."""
    seed_everything(cfg.seed)
    engine = start_engine(
        model_cfg, cfg.parallel, cfg.optim, dims, device, cfg.seed, choices, initial
    )
    return engine, start_hooks(engine, cfg.optim.qk_clip_tau, canonical)


@dataclass
class Restart:
    """Where training (re)starts: what a resume restored, or a fresh start."""

    engine: TrainingEngine | None
    hooks: list[TrainingHook]  # the engine's training hooks (trainer.hooks)
    step: int = 0
    tokens: int = 0
    bad_streak: int = 0
    skipped_total: int = 0
    restored_step: int = -1  # the step of the checkpoint this run resumed from
    wandb_id: str | None = None
    start_over: bool = False  # failed loads may have left the engine half-read: rebuild it


def _resume(
    cfg: RootConfig,
    run_dir: Path,
    ranks: Ranks,
    checkpointer: Checkpointer,
    restart: Restart,
    loader: TokenLoader,
    tracker: LossTracker,
    metrics: MetricsFile,
) -> Restart:
    restart.engine.scratch_dir = run_dir  # e.g. DeepSpeed's conversion of another rank count's
    restored, failed = resume(
        cfg.resume,
        checkpointer.root,
        restart.engine,
        ranks.rank,
        checkpointer.fingerprint,
        cfg.checkpoint.verify,
    )
    if restored is None:
        if failed:  # the failed loads may have left weights or moments half-read
            kept = set_aside(failed, run_dir, ranks.is_main)
            log.warning(
                "no checkpoint could be loaded: they were moved to %s (nothing deleted), and the "
                "run starts from scratch, freshly initialized (from init_from's weights if set)",
                kept,
            )
            restart.start_over = True
        elif cfg.resume == "auto":
            start = f"a new run from init_from={cfg.init_from}" if cfg.init_from else "from scratch"
            log.info("no checkpoint in %s: starting %s", checkpointer.root, start)
        checkpointer.run_id = from_main(uuid.uuid4().hex[:12])
        metrics.truncate_after(-1)  # rows of an earlier attempt that saved nothing
        return restart
    # the config given now wins over the saved hyperparameters
    apply_config(restart.engine.optimizer, cfg.optim)
    extra = restored.extra
    checkpointer.run_id = extra.get("run_id") or from_main(uuid.uuid4().hex[:12])
    if restored.path.resolve().parent == checkpointer.root.resolve():  # this run's own
        checkpointer.last_committed = restored.path
        restart.restored_step = extra["step"]
    restart.step, restart.tokens = extra["step"], extra["tokens"]
    restart.bad_streak, restart.skipped_total = extra["bad_streak"], extra["skipped_total"]
    restart.wandb_id = extra.get("wandb_id")
    tracker.load_state_dict(extra["loss_tracker"])
    loader.load_state_dict(extra["loader"])
    set_rng_state(extra["rng"])
    metrics.truncate_after(restart.step)
    log.info("resumed from %s at step %d (%d tokens)", restored.path, restart.step, restart.tokens)
    return restart


def _fresh_if_needed(
    restart: Restart, fresh: Callable[[], tuple[TrainingEngine, list[TrainingHook]]]
) -> None:
    """A freshly initialized engine (and its hooks) from `fresh()` in `restart` after failed
    loads."""
    if not restart.start_over:
        return
    restart.engine, restart.hooks = None, []  # free the half-read one before its replacement
    gc.collect()
    restart.engine, restart.hooks = fresh()


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
