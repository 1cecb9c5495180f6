"""Builders of the composition root: dataset, loader, model and the cross-field checks.

Each takes only its own sub-configs (never the root config into a component), and every rule that
spans groups fails here, at start-up, with a message that names the keys involved.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from data.config import LoaderConfig, PrepareConfig
from data.loader import TokenLoader
from data.manifest import Manifest
from data.prepare import prepare
from model.config import ModelConfig
from model.errors import ConfigError
from model.stages import pipeline_layouts, stages_per_rank
from optim.builder import build_optimizer
from optim.config import OptimConfig
from parallel import ENGINES, EngineRequest, TrainingEngine, build_engine
from parallel.collective import from_main
from parallel.config import Float8Config, ParallelConfig
from parallel.float8 import check_float8_tokens, require_torchao
from parallel.mesh import ParallelDims
from parallel.precision import resolve_precision
from trainer.config import RootConfig, TrainerConfig, compiles
from trainer.downstream.tasks import check_task_names
from trainer.hf_init import is_hf
from trainer.run_settings import BatchPlan, plan_batches

log = logging.getLogger("trainer")
VOCAB_MULTIPLE = 64


def dataset_manifest(data: LoaderConfig, is_main: bool) -> Manifest:
    """The manifest at `data.path`; with `data.path=""`, the default corpus, prepared on first use
    by rank 0 while the other ranks wait for it (torchrun ends them all if rank 0 fails), then
    reused."""
    if data.path:
        return Manifest.load(data.path)
    default = PrepareConfig(progress=is_main)
    path = default.output_dir()
    if is_main and not (path / "manifest.json").is_file():
        log.info("preparing the default corpus (Python's standard library) in %s", path)
        prepare(default)
    from_main(None)  # every rank past this point sees rank 0's preparation
    if not (path / "manifest.json").is_file():
        raise ConfigError(
            f"the default dataset {path} is not on this node (rank 0 prepared it on its own); "
            "run `python -m data.prepare` once on every node, or set LMFORGE_DATA_DIR to a "
            "directory all nodes share"
        )
    return Manifest.load(path)


def resolve_model_config(model: ModelConfig, manifest: Manifest) -> ModelConfig:
    """`model.vocab_size=0` takes the tokenizer's vocabulary padded to a multiple of 64; an
    explicit vocabulary must cover every token id."""
    tokenizer_vocab = manifest.vocab_size
    if model.vocab_size == 0:
        padded = -(-tokenizer_vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
        return dataclasses.replace(model, vocab_size=padded)
    if model.vocab_size < tokenizer_vocab:
        raise ConfigError(
            f"model.vocab_size={model.vocab_size} is smaller than the tokenizer's {tokenizer_vocab} "
            f"ids ({manifest.tokenizer.short()} in {manifest.root}); set model.vocab_size=0 to "
            f"take the tokenizer's, padded to a multiple of {VOCAB_MULTIPLE}"
        )
    return model


def context_limit(model: ModelConfig) -> int:
    """The longest sequence the model takes: max_seq_len, or what its rope scaling reaches."""
    limit = model.max_seq_len
    if model.rope.scaling != "none":
        limit = max(limit, int(model.rope_original_max_seq_len * model.rope.factor))
    return limit


def check_context(model: ModelConfig, data: LoaderConfig) -> None:
    """data.seq_len fits the model's context (rope scaling included)."""
    limit = context_limit(model)
    if data.seq_len > limit:
        raise ConfigError(
            f"data.seq_len={data.seq_len} exceeds the model's context of {limit} tokens "
            f"(model.max_seq_len={model.max_seq_len}, rope scaling {model.rope.scaling!r} x "
            f"{model.rope.factor}); lower data.seq_len or raise model.max_seq_len"
        )


def build_loader(
    data: LoaderConfig, manifest: Manifest, global_batch: int, rank: int, size: int, seed: int
) -> TokenLoader:
    resolved = dataclasses.replace(data, path=str(manifest.root))
    return TokenLoader(
        resolved,
        global_batch=global_batch,
        dp_rank=rank,
        dp_size=size,
        seed=seed,
        pin_memory=torch.cuda.is_available(),
    )


@dataclass(frozen=True)
class EngineChoices:
    """The trainer's choices an engine is built with, resolved once (trainer.app)."""

    precision: str  # trainer.precision, resolved: fp32 | bf16 | bf16_master | float8
    compile: bool  # trainer.compile, resolved (trainer.config.compiles)
    grad_clip: float  # trainer.grad_clip (engines that clip inside their own step)
    plan: BatchPlan  # the step's micro-batch size and count
    seq_len: int = 0  # data.seq_len (a pipeline's stage shapes and split)
    float8: Float8Config = dataclasses.field(default_factory=Float8Config)  # trainer.float8


def build_training_engine(
    model_cfg: ModelConfig,
    trainer: TrainerConfig,
    parallel: ParallelConfig,
    optim: OptimConfig,
    dims: ParallelDims,
    device: torch.device,
    seed: int,
    initial_weights: Callable[[], Iterable[dict[str, torch.Tensor]]] | None = None,
) -> TrainingEngine:
    """start_engine for Python callers holding a TrainerConfig (tests, benchmarks): its choices
    resolved here, silently, after the checks `python -m trainer` runs at start-up."""
    check_expert_parallel(model_cfg, dims, parallel.activation_checkpoint)
    choices = EngineChoices(
        precision=resolve_precision(trainer.precision, device),
        compile=compiles(trainer),
        grad_clip=trainer.grad_clip,
        plan=batch_plan(trainer, parallel, dims),
        float8=trainer.float8,
    )
    return start_engine(model_cfg, parallel, optim, dims, device, seed, choices, initial_weights)


def start_engine(
    model_cfg: ModelConfig,
    parallel: ParallelConfig,
    optim: OptimConfig,
    dims: ParallelDims,
    device: torch.device,
    seed: int,
    choices: EngineChoices,
    initial_weights: Callable[[], Iterable[dict[str, torch.Tensor]]] | None = None,
) -> TrainingEngine:
    """The engine named by parallel.engine, with the model (sharded when there are several
    ranks) starting from the weights one process would have (seeded by `seed`), or from
    `initial_weights()`, and the optimizer of `optim` over the weights it updates (the fp32
    masters under bf16_master)."""
    check_float8_engine(choices.precision, parallel.engine)
    request = EngineRequest(
        model_cfg=model_cfg,
        parallel=parallel,
        precision=choices.precision,
        compile=choices.compile,
        dims=dims,
        device=device,
        seed=seed,
        make_optimizer=lambda weights: build_optimizer(optim, weights),
        grad_clip=choices.grad_clip,
        micro_batch_size=choices.plan.micro_batch_size,
        micro_batches=choices.plan.micro_batches,
        seq_len=choices.seq_len,
        optimizer_name=optim.name,
        initial_weights=initial_weights,
        float8=choices.float8,
    )
    return build_engine(parallel.engine, request)


def check_float8_engine(precision: str, engine: str) -> None:
    """trainer.precision=float8 runs in the fsdp2 engine (torchao's float8 modules, FSDP2's
    float8 all-gather); DeepSpeed's own FP8 path is not wired here."""
    if precision == "float8" and engine != "fsdp2":
        raise ConfigError(
            f"trainer.precision=float8 is not available with parallel.engine={engine} (torchao's "
            "float8 training is wired into the fsdp2 engine only); use parallel.engine=fsdp2 or "
            "trainer.precision=bf16"
        )


def check_expert_parallel(cfg: ModelConfig, dims: ParallelDims, checkpointing: str) -> None:
    """Both expert-parallel rules (Python callers; the trainer runs each part where its inputs
    are final)."""
    check_expert_layout(dims, checkpointing)
    check_expert_count(cfg, dims)


def check_start(cfg: RootConfig, world_size: int) -> tuple[ParallelDims, BatchPlan]:
    """Every start-up rule that needs neither data nor a device, for `world_size` ranks: the
    parallel layout, the engine's name, the batch plan and, unless the model comes from a Hugging
    Face checkpoint (init_from=hf:, shaped by its config.json), the model's shape against the
    layout and data.seq_len. `python -m trainer` runs them before touching any file;
    launch.torchrun before starting a worker."""
    dims = ParallelDims.resolve(cfg.parallel, world_size)
    ENGINES.get(cfg.parallel.engine)  # an unknown parallel.engine names the known ones
    check_float8_engine(cfg.trainer.precision, cfg.parallel.engine)
    if cfg.trainer.precision == "float8":
        require_torchao()
    check_expert_layout(dims, cfg.parallel.activation_checkpoint)
    check_sequence_split(cfg.parallel.sequence_parallel, cfg.data.seq_len, dims)
    check_context_split(cfg.parallel.sequence_parallel, cfg.data.seq_len, dims)
    split_by = "parallel.cp > 1" if dims.cp > 1 else "parallel.sequence_parallel=true"
    if (dims.cp > 1 or cfg.parallel.sequence_parallel) and cfg.model.moe.capacity_factor > 0:
        # each rank routes its own positions through the experts: capacity would be per rank
        raise ConfigError(
            f"model.moe.capacity_factor={cfg.model.moe.capacity_factor:g} with {split_by}: "
            "the experts see each rank's positions apart, so what is dropped would depend on "
            "the split; set model.moe.capacity_factor=0"
        )
    if dims.cp > 1 and cfg.parallel.engine != "fsdp2":
        raise ConfigError(
            f"parallel.cp={dims.cp} runs on parallel.engine=fsdp2 (parallel.engine="
            f"{cfg.parallel.engine} does not split sequences); set parallel.engine=fsdp2"
        )
    plan = batch_plan(cfg.trainer, cfg.parallel, dims)
    if cfg.trainer.precision == "float8":
        tokens = plan.micro_batch_size * cfg.data.seq_len // dims.cp
        check_float8_tokens(cfg.trainer.float8.recipe, tokens)
    if dims.pp > 1:
        check_pipeline(cfg, dims)
    if not is_hf(cfg.init_from):
        check_model_shape(cfg.model, cfg.data, dims)
    if cfg.eval.downstream.tasks:  # names known to the library (and the library installed)
        check_task_names(cfg.eval.downstream.tasks)
    return dims, plan


def batch_plan(trainer: TrainerConfig, parallel: ParallelConfig, dims: ParallelDims) -> BatchPlan:
    """The step's batch arithmetic; under pipeline parallelism the micro-batches are the
    schedule's (parallel.pp_microbatches, else trainer.micro_batch_size, else one per stage)."""
    micro = trainer.micro_batch_size
    if dims.pp > 1 and not micro:
        local = plan_batches(trainer.batch_size, 0, dims.dp_ranks).local_batch
        count = parallel.pp_microbatches or dims.pp * stages_per_rank(
            parallel.pp_schedule, parallel.pp_stages_per_rank
        )
        if local % count:
            raise ConfigError(
                f"{local} sequences per data-parallel rank (trainer.batch_size="
                f"{trainer.batch_size}) do not split into {count} pipeline micro-batches; set "
                "parallel.pp_microbatches to a divisor of it"
            )
        micro = local // count
    plan = plan_batches(trainer.batch_size, micro, dims.dp_ranks)
    if dims.pp > 1 and parallel.pp_microbatches not in (0, plan.micro_batches):
        raise ConfigError(
            f"parallel.pp_microbatches={parallel.pp_microbatches} and trainer.micro_batch_size="
            f"{trainer.micro_batch_size} disagree ({plan.micro_batches} micro-batches of "
            f"{plan.micro_batch_size}); set only one of them"
        )
    return plan


def check_pipeline(cfg: RootConfig, dims: ParallelDims) -> None:
    """What pipeline parallelism does not run with, refused before any process group exists."""
    if cfg.parallel.engine != "fsdp2":
        raise ConfigError(
            f"parallel.pp={dims.pp} runs on parallel.engine=fsdp2 (parallel.engine="
            f"{cfg.parallel.engine} has no pipeline stages here); set parallel.engine=fsdp2 or "
            "parallel.pp=1"
        )
    from parallel.pipeline_split import check_pipeline_model

    check_pipeline_model(cfg.model, cfg.parallel)
    if not is_hf(cfg.init_from):  # the stages: an explicit split that does not fit, ...
        p, model = cfg.parallel, meta_model(cfg.model)
        per_rank, layers = p.pp_stages_per_rank, p.pp_layers
        pipeline_layouts(model, cfg.data.seq_len, dims.pp, p.pp_schedule, per_rank, layers)


def check_model_shape(model_cfg: ModelConfig, data: LoaderConfig, dims: ParallelDims) -> None:
    """The rules that need the model's final shape: its experts over parallel.ep, its layers'
    heads over parallel.tp, and data.seq_len within its context."""
    check_expert_count(model_cfg, dims)
    check_tensor_parallel_plans(model_cfg, dims.tp)
    check_context_parallel_layers(model_cfg, dims.cp)
    check_context(model_cfg, data)


def check_tensor_parallel_plans(model_cfg: ModelConfig, tp: int) -> None:
    """Every layer's own tensor-parallel plan for `tp` ranks (a layer whose heads tp cannot
    split refuses in one line), on a model built on the meta device: at start-up, not after
    the process group and the data are set up."""
    if tp == 1:
        return
    model = meta_model(model_cfg)
    for module in model.modules():
        plan = getattr(module, "tensor_parallel_plan", None)
        if plan is not None:
            plan(tp)


def meta_model(model_cfg: ModelConfig):
    """The model on the meta device (no memory), for start-up checks of its layers; vocab_size 0
    (the tokenizer's) stands in as 8192: any size splits by rows."""
    from model.transformer import build_model

    vocab = model_cfg.vocab_size or 8192
    return build_model(dataclasses.replace(model_cfg, vocab_size=vocab), device="meta")


def check_context_parallel_layers(model_cfg: ModelConfig, cp: int) -> None:
    """Every layer of the model splits over the sequence (on the meta device, at start-up)."""
    if cp == 1:
        return
    from parallel.context_parallel import context_parallel_refusal

    if problem := context_parallel_refusal(meta_model(model_cfg)):
        raise ConfigError(problem)


def check_context_split(sequence_parallel: bool, seq_len: int, dims: ParallelDims) -> None:
    """parallel.cp splits each training window into 2 cp head-tail chunks (and sequence
    parallelism splits each rank's two chunks over tp)."""
    if dims.cp == 1:
        return
    parts = 2 * dims.cp
    if seq_len % parts:
        raise ConfigError(
            f"parallel.cp={dims.cp} splits each window of data.seq_len={seq_len} into 2 x cp = "
            f"{parts} chunks; make data.seq_len a multiple of {parts}"
        )
    if sequence_parallel and (seq_len // dims.cp) % dims.tp:
        multiple = math.lcm(parts, dims.cp * dims.tp)
        raise ConfigError(
            f"parallel.cp={dims.cp} with parallel.sequence_parallel=true splits each rank's "
            f"{seq_len // dims.cp} positions over parallel.tp={dims.tp}; make data.seq_len a "
            f"multiple of {multiple}"
        )


def check_sequence_split(sequence_parallel: bool, seq_len: int, dims: ParallelDims) -> None:
    """parallel.sequence_parallel splits each training window into tp equal parts."""
    if sequence_parallel and seq_len % dims.tp:
        raise ConfigError(
            f"parallel.sequence_parallel=true splits each window of data.seq_len={seq_len} over "
            f"parallel.tp={dims.tp} ranks; make data.seq_len a multiple of {dims.tp}"
        )


def check_expert_layout(dims: ParallelDims, checkpointing: str) -> None:
    """parallel.ep > 1 with the activation checkpointing it supports (no model needed)."""
    if dims.ep > 1 and checkpointing == "selective":
        # selective checkpointing replays saved ops by invocation order, which the token
        # exchange's collectives break in the recompute (torch 2.13); full recomputation works
        raise ConfigError(
            "parallel.activation_checkpoint=selective does not work with parallel.ep > 1 yet; "
            "use parallel.activation_checkpoint=full (or none)"
        )


def check_expert_count(cfg: ModelConfig, dims: ParallelDims) -> None:
    """parallel.ep > 1 needs routed experts that divide over the expert-parallel ranks."""
    if dims.ep == 1:
        return
    experts = cfg.moe.n_routed_experts
    if experts == 0:
        raise ConfigError(
            f"parallel.ep={dims.ep} needs a MoE model (model.moe.n_routed_experts > 0, e.g. "
            "model=tiny_moe); set parallel.ep=1 for a dense model"
        )
    if experts % dims.ep:
        raise ConfigError(
            f"model.moe.n_routed_experts={experts} is not divisible by parallel.ep={dims.ep}"
        )
