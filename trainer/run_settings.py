"""Settings resolved once at start-up, into the small frozen objects the parts take.

`plan_batches` turns trainer.batch_size / micro_batch_size and the data-parallel rank count into
a `BatchPlan` (validated here, once); the engine request, the step, the loop and the start-up log
read it. `LoopSettings` is what the loop (trainer/loop.py) reads instead of the root config;
trainer.app builds it once.
"""

from __future__ import annotations

from dataclasses import dataclass

from model.errors import ConfigError


@dataclass(frozen=True)
class BatchPlan:
    """How a global batch of sequences splits over the ranks and micro-batches of one step."""

    global_batch: int  # trainer.batch_size: sequences per step, all ranks together
    dp_ranks: int  # data-parallel ranks the global batch is split over
    local_batch: int  # sequences per rank and step
    micro_batch_size: int  # sequences per forward on one rank
    micro_batches: int  # forwards accumulated into one step on each rank


def plan_batches(batch_size: int, micro_batch_size: int, dp_ranks: int) -> BatchPlan:
    """The step's batch arithmetic (`micro_batch_size` 0 = the whole local batch); a
    ConfigError naming the keys when the sizes do not divide."""
    local, remainder = divmod(batch_size, dp_ranks)
    if remainder:
        raise ConfigError(
            f"trainer.batch_size={batch_size} is not divisible by the {dp_ranks} "
            f"data-parallel ranks"
        )
    micro = micro_batch_size or local
    if local % micro:
        raise ConfigError(
            f"trainer.batch_size={batch_size} is not divisible by trainer.micro_batch_size="
            f"{micro} x {dp_ranks} data-parallel ranks"
        )
    return BatchPlan(batch_size, dp_ranks, local, micro, local // micro)


@dataclass(frozen=True)
class LoopSettings:
    """What the training loop reads of the run's settings (trainer.*, checkpoint.every,
    logging.progress, seed), with the compile decision and the step's token count resolved."""

    max_steps: int  # trainer.max_steps
    log_every: int  # trainer.log_every
    eval_every: int  # trainer.eval_every; 0 = only at the end
    sample_tokens: int  # trainer.sample_tokens; 0 = no sample
    checkpoint_every: int  # checkpoint.every; 0 = only at the end
    max_bad_steps: int  # trainer.max_bad_steps
    requeue: bool  # trainer.requeue
    fault_step: int  # trainer.fault_step; -1 = off
    fault_rank: int  # trainer.fault_rank; -1 = every rank
    compiled: bool  # trainer.compile, resolved (trainer.config.compiles)
    compile_eval: str  # trainer.compile_eval: auto | true | false
    tokens_per_step: int  # global batch x data.seq_len
    seed: int  # seeds each evaluation's sample (seed + step)
    progress: bool  # logging.progress: a progress bar on the main rank
