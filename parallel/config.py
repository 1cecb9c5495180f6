"""Parallelism settings (`parallel.*`): mesh sizes, activation checkpointing, FSDP2 policy."""

from __future__ import annotations

from dataclasses import dataclass, field

from model.errors import ConfigError

AC_MODES = ("none", "full", "selective")
PARAM_DTYPES = ("auto", "bf16", "fp32")
BACKENDS = ("auto", "nccl", "gloo")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


OFFLOAD_DEVICES = ("none", "cpu", "nvme")


@dataclass(kw_only=True)
class DeepSpeedConfig:
    """`parallel.engine=deepspeed` (parallel/deepspeed/engine.py): ZeRO over every rank."""

    zero_stage: int = (
        2  # 0 (plain data parallel), 1 (optimizer states), 2 (+ gradients), 3 (+ weights)
    )
    offload_optimizer: str = "none"  # none | cpu | nvme: optimizer states and step off the device
    offload_params: str = "none"  # none | cpu | nvme: weights off the device (ZeRO-3 only)
    nvme_path: str = ""  # the directory nvme offload swaps to
    # a DeepSpeed JSON whose other settings pass through; the keys set here or by the trainer
    # (batch sizes, clipping, precision, ZeRO stage and offload) are filled in, and a file that
    # sets one of them to another value is refused
    config: str = ""

    def __post_init__(self) -> None:
        _require(
            self.zero_stage in (0, 1, 2, 3),
            f"parallel.deepspeed.zero_stage={self.zero_stage} must be 0, 1, 2 or 3",
        )
        for key in ("offload_optimizer", "offload_params"):
            value = getattr(self, key)
            _require(
                value in OFFLOAD_DEVICES,
                f"parallel.deepspeed.{key}={value!r} is not one of {OFFLOAD_DEVICES}",
            )
        _require(
            self.offload_params == "none" or self.zero_stage == 3,
            f"parallel.deepspeed.offload_params={self.offload_params} needs zero_stage=3 "
            f"(ZeRO-{self.zero_stage} keeps whole weights on every rank)",
        )
        _require(
            self.offload_optimizer == "none" or self.zero_stage >= 1,
            "parallel.deepspeed.offload_optimizer needs zero_stage >= 1",
        )
        nvme = "nvme" in (self.offload_optimizer, self.offload_params)
        _require(
            not nvme or bool(self.nvme_path),
            "nvme offload needs parallel.deepspeed.nvme_path (a directory on a fast local disk)",
        )


FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8")
FLOAT8_FILTERS = ("auto", "all")


@dataclass(kw_only=True)
class Float8Config:
    """`trainer.float8.*`: how `trainer.precision=float8` runs (parallel/float8.py, torchao)."""

    # tensorwise (one scale per tensor; float8 FSDP2 all-gathers and TP styles; the fastest on
    # H100/H200) | rowwise (a scale per row: more accurate, SM89+) | rowwise_with_gw_hp (rowwise,
    # weight gradients in bf16) | mxfp8 (a scale per 32 values; SM100 / B200, emulated on CPU)
    recipe: str = "tensorwise"
    # which qualifying matmuls run in float8: auto (torchao's size thresholds, measured on H100:
    # smaller GEMMs are faster in bf16) | all (every one whose dims the kernels accept)
    filter: str = "auto"
    skip: list[str] = field(default_factory=list)  # module names (or name parts) kept in bf16
    # tensorwise with several data-parallel ranks: FSDP2 gathers float8 weights (half the bytes
    # of bf16), their scales computed once after each optimizer step
    fsdp_all_gather: bool = True
    # routed experts' grouped GEMMs in float8 too: rowwise on SM90/SM100 (torch._scaled_grouped_mm),
    # MXFP8 on SM100 or emulated on CPU; else they stay in the compute dtype
    experts: bool = True

    def __post_init__(self) -> None:
        _require(
            self.recipe in FLOAT8_RECIPES,
            f"trainer.float8.recipe={self.recipe!r} is not one of {FLOAT8_RECIPES}",
        )
        _require(
            self.filter in FLOAT8_FILTERS,
            f"trainer.float8.filter={self.filter!r} is not one of {FLOAT8_FILTERS}",
        )


@dataclass(kw_only=True)
class ParallelConfig:
    dp_shard: int = -1  # ranks that shard dense weights (FSDP2); -1 = all that remain
    dp_replicate: int = 1  # replicas of the sharded group (HSDP when both > 1)
    ep: int = 1  # expert-parallel ranks, taken from dp_shard (experts split over them)
    # tensor-parallel ranks (heads, hidden units and vocabulary split over them; consecutive
    # ranks, so keep it within a node)
    tp: int = 1
    # context-parallel ranks: each computes 1 / cp of every sequence's positions (head-tail
    # chunks, so causal attention work is even) and they exchange keys and values (softmax
    # attention) or states (Gated DeltaNet, KDA) per layer; for long contexts (parallel/
    # context_parallel.py). data.seq_len must split into 2 x cp chunks
    cp: int = 1
    # pipeline-parallel ranks (outermost: across nodes): the stack split into stages that pass
    # the residual stream on, micro-batch by micro-batch, under torch.distributed.pipelining's
    # schedule `pp_schedule` (parallel/pipeline.py)
    pp: int = 1
    # GPipe | 1F1B | Interleaved1F1B | LoopedBFS | InterleavedZeroBubble | ZBVZeroBubble |
    # DualPipeV (the last five run several stages per rank)
    pp_schedule: str = "1F1B"
    # micro-batches each pipeline runs per step (its gradient accumulation); 0 = from
    # trainer.micro_batch_size, or the number of stages when that is 0 too
    pp_microbatches: int = 0
    # blocks per stage, in order (e.g. [3, 5]); [] = balanced by each block's FLOPs, the head's
    # counted on the last stage
    pp_layers: list[int] = field(default_factory=list)
    pp_stages_per_rank: int = 0  # 0 = 1 for GPipe/1F1B, 2 for the multi-stage schedules
    # with tp > 1: the residual stream between sublayers split along the sequence over the tp
    # ranks (norms, residuals, AttnRes/mHC streams take 1 / tp of their activation memory), at
    # one all-gather of the sublayer input more per sublayer (parallel/sequence_parallel.py)
    sequence_parallel: bool = False
    # with tp > 1 on CUDA and trainer.compile: Inductor overlaps an all-gather with the matmul
    # it feeds, chunk by chunk (torch._inductor.config._micro_pipeline_tp, "async TP"; the
    # all-gathers are sequence parallelism's)
    async_tp: bool = False
    activation_checkpoint: str = "none"  # none | full (recompute each block) | selective
    reshard_after_forward: bool = True  # FSDP2: free gathered weights after forward (ZeRO-3)
    param_dtype: str = "auto"  # FSDP2 gather/compute dtype: auto (bf16 unless precision=fp32)
    backend: str = "auto"  # process group backend: auto (nccl with CUDA, else gloo) | nccl | gloo
    # seconds a collective may wait for the other ranks before this rank gives up (a hung or
    # dead rank); raise it when ranks legitimately drift apart longer (long compiles or saves)
    timeout_s: float = 300.0
    # the training engine (parallel.engine.ENGINES): fsdp2 = one process or FSDP2/HSDP (+ EP);
    # deepspeed = DeepSpeed's ZeRO (parallel.deepspeed)
    engine: str = "fsdp2"
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)

    def __post_init__(self) -> None:
        _require(
            self.dp_shard == -1 or self.dp_shard >= 1,
            f"parallel.dp_shard={self.dp_shard} must be >= 1, or -1 for all remaining ranks",
        )
        for key in ("dp_replicate", "ep", "tp", "cp", "pp"):
            value = getattr(self, key)
            _require(value >= 1, f"parallel.{key}={value} must be >= 1")
        _require(
            self.activation_checkpoint in AC_MODES,
            f"parallel.activation_checkpoint={self.activation_checkpoint!r} is not one of {AC_MODES}",
        )
        _require(
            self.param_dtype in PARAM_DTYPES,
            f"parallel.param_dtype={self.param_dtype!r} is not one of {PARAM_DTYPES}",
        )
        _require(
            self.backend in BACKENDS, f"parallel.backend={self.backend!r} is not one of {BACKENDS}"
        )
        _require(
            not (self.sequence_parallel or self.async_tp) or self.tp > 1,
            "parallel.sequence_parallel and parallel.async_tp split work over the tensor-parallel "
            f"ranks: they need parallel.tp > 1 (got parallel.tp={self.tp})",
        )
        _require(self.timeout_s > 0, f"parallel.timeout_s={self.timeout_s} must be > 0")
        for key in ("pp_microbatches", "pp_stages_per_rank"):
            value = getattr(self, key)
            _require(value >= 0, f"parallel.{key}={value} must be >= 0 (0 = automatic)")
        if self.pp > 1:
            from model.stages import stages_per_rank

            stages_per_rank(self.pp_schedule, self.pp_stages_per_rank)
