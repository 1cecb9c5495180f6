"""Builders of the composition root: dataset, loader, model and the cross-field checks.

Each takes only its own sub-configs (never the root config into a component), and every rule that
spans groups fails here, at start-up, with a message that names the keys involved.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable

import torch

from data.config import LoaderConfig, PrepareConfig
from data.loader import TokenLoader
from data.manifest import Manifest
from data.prepare import prepare
from model.config import ModelConfig
from model.errors import ConfigError
from optim.builder import build_optimizer
from optim.config import OptimConfig
from parallel import EngineRequest, TrainingEngine, build_engine
from parallel.config import ParallelConfig
from parallel.mesh import ParallelDims
from parallel.precision import resolve_precision
from trainer.config import TrainerConfig, compiles

log = logging.getLogger("trainer")
VOCAB_MULTIPLE = 64


def dataset_manifest(data: LoaderConfig, is_main: bool) -> Manifest:
    """The manifest at `data.path`; with `data.path=""`, the default corpus (prepared on first
    use by rank 0, then reused)."""
    if data.path:
        return Manifest.load(data.path)
    default = PrepareConfig(progress=is_main)
    path = default.output_dir()
    if not (path / "manifest.json").is_file():
        if not is_main:
            raise ConfigError(
                f"the default dataset {path} is not prepared; run `python -m data.prepare` once "
                "(or a single-process `python -m trainer`) before launching several ranks"
            )
        log.info("preparing the default corpus (Python's standard library) in %s", path)
        prepare(default)
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


def check_cross_fields(
    model: ModelConfig, data: LoaderConfig, trainer: TrainerConfig, dp_size: int
) -> int:
    """Batch arithmetic and sequence length; returns micro-batches per step."""
    local, remainder = divmod(trainer.batch_size, dp_size)
    if remainder:
        raise ConfigError(
            f"trainer.batch_size={trainer.batch_size} is not divisible by the {dp_size} "
            f"data-parallel ranks"
        )
    micro = trainer.micro_batch_size or local
    if local % micro:
        raise ConfigError(
            f"trainer.batch_size={trainer.batch_size} is not divisible by trainer.micro_batch_size="
            f"{micro} x {dp_size} data-parallel ranks"
        )
    limit = model.max_seq_len
    if model.rope.scaling != "none":
        limit = max(limit, int(model.rope_original_max_seq_len * model.rope.factor))
    if data.seq_len > limit:
        raise ConfigError(
            f"data.seq_len={data.seq_len} exceeds the model's context of {limit} tokens "
            f"(model.max_seq_len={model.max_seq_len}, rope scaling {model.rope.scaling!r} x "
            f"{model.rope.factor}); lower data.seq_len or raise model.max_seq_len"
        )
    return local // micro


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
    """The engine named by parallel.engine, with the model (sharded when there are several
    ranks) starting from the weights one process would have (seeded by `seed`), or from
    `initial_weights()`, and the optimizer of `optim` over the weights it updates (the fp32
    masters under bf16_master)."""
    check_expert_parallel(model_cfg, dims, parallel.activation_checkpoint)
    local = trainer.batch_size // dims.world_size  # sequences per rank and step
    micro = trainer.micro_batch_size or local
    request = EngineRequest(
        model_cfg=model_cfg,
        parallel=parallel,
        precision=resolve_precision(trainer.precision, device),
        compile=compiles(trainer),
        dims=dims,
        device=device,
        seed=seed,
        make_optimizer=lambda weights: build_optimizer(optim, weights),
        grad_clip=trainer.grad_clip,
        micro_batch_size=micro,
        micro_batches=local // micro,
        optimizer_name=optim.name,
        initial_weights=initial_weights,
    )
    return build_engine(parallel.engine, request)


def check_expert_parallel(cfg: ModelConfig, dims: ParallelDims, checkpointing: str) -> None:
    if dims.ep == 1:
        return
    if checkpointing == "selective":
        # selective checkpointing replays saved ops by invocation order, which the token
        # exchange's collectives break in the recompute (torch 2.13); full recomputation works
        raise ConfigError(
            "parallel.activation_checkpoint=selective does not work with parallel.ep > 1 yet; "
            "use parallel.activation_checkpoint=full (or none)"
        )
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
