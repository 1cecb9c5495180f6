"""The one composition path: a plain model built on the meta device, rewritten in a fixed order
(float8 matmuls -> expert parallelism -> tensor parallelism -> context parallelism -> activation checkpointing ->
compile per block -> FSDP2), then allocated
and filled with the weights a single process would have started from.

The same path serves one process and many. With one rank there is no mesh, so the EP and FSDP
stages are skipped; FSDP2 is not applied at degree 1 (torchtitan does, to share its
mixed-precision mechanism): here a single process keeps its own precision schemes (autocast over
fp32 weights, or bf16 weights with an fp32 copy), which need no process group, keep the
single-process numbers the tests and benchmarks compare against, and cost no per-step
gather/reduce hooks. Compile is per block in every layout (FSDP2's hooks run between blocks),
plus the fused head + loss as a function.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from model.errors import ConfigError
from model.transformer import Transformer
from parallel.activation import apply_activation_checkpointing, compile_model
from parallel.config import Float8Config, ParallelConfig
from parallel.engine import ENGINES, EngineRequest, FSDP2Engine
from parallel.float8 import Float8Plan, convert_to_float8, gather_float8_as_bytes
from parallel.fsdp import apply_fsdp, mixed_precision
from parallel.init import init_like_single_process, load_weights
from parallel.mesh import Meshes, build_meshes
from parallel.precision import MasterWeights

log = logging.getLogger("parallel")


def fsdp_param_dtype(cfg: ParallelConfig, precision: str) -> torch.dtype:
    """`parallel.param_dtype=auto`: bf16 gathers/compute unless the trainer computes in fp32."""
    if cfg.param_dtype == "auto":
        return torch.float32 if precision == "fp32" else torch.bfloat16
    return torch.bfloat16 if cfg.param_dtype == "bf16" else torch.float32


def parallelize(
    model: Transformer,
    meshes: Meshes | None,
    cfg: ParallelConfig,
    param_dtype: torch.dtype,
    compile: bool,
    device_type: str,
    fsdp: bool = True,
    float8: Float8Config | None = None,
) -> Float8Plan | None:
    """Rewrite `model` (on the meta device) in place for the mesh (None: one process) and the
    device it will run on (device_type: "cpu", "cuda"); `fsdp` False: all but FSDP2 (a
    pipeline shards each stage on its own). `float8` (trainer.precision=float8): its matmuls
    converted first; returns what was converted (None without float8)."""
    plan = None
    if float8 is not None:
        tp = meshes.dims.tp if meshes is not None else 1
        plan = convert_to_float8(model, float8, torch.device(device_type), meshes is not None, tp)
        # (the first rank of each pipeline stage: each holds its own stages' matmuls)
        if meshes is None or dist.get_rank() % meshes.dims.ranks_per_stage == 0:
            log.info("%s", plan.summary())
    if meshes is not None and meshes.ep is not None:
        from parallel.expert_parallel import apply_expert_parallel

        apply_expert_parallel(model, meshes.ep)
    if meshes is not None and meshes.tp is not None:
        from parallel.tensor_parallel import split_over_tp

        replicated = split_over_tp(model, meshes.tp, cfg.sequence_parallel)
        if cfg.async_tp:
            enable_async_tp(compile, device_type, meshes.tp)
        if replicated:  # exact, but each tp rank holds and computes these whole
            log.info(
                "tensor parallelism: %d module(s) without a plan run whole on every tp rank: %s",
                len(replicated),
                ", ".join(_shorten(replicated)),
            )
    if meshes is not None and meshes.cp is not None:
        from parallel.context_parallel import apply_context_parallel

        apply_context_parallel(model, meshes.cp.get_group())
        cp = meshes.dims.cp
        log.info(
            "context parallelism: each rank computes 2 of the %d head-tail chunks of every "
            "training sequence (1 / %d of its positions)",
            2 * cp,
            cp,
        )
    apply_activation_checkpointing(model, cfg.activation_checkpoint)
    if compile:
        compile_model(model, device_type)
    if meshes is not None and fsdp:
        apply_fsdp(
            model,
            meshes,
            mixed_precision(param_dtype),
            cfg.reshard_after_forward,
            recompute=cfg.activation_checkpoint != "none",
        )
        if plan is not None and plan.all_gather:
            gather_float8_as_bytes(model)
    return plan


def enable_async_tp(compile: bool, device_type: str, tp_mesh: object = None) -> None:
    """parallel.async_tp: Inductor's micro-pipelined tensor parallelism. In compiled graphs on
    CUDA it splits an all-gather feeding a matmul into chunks that overlap (sequence
    parallelism's gathers; the row-wise projections end in all-reduces, which it does not
    fuse). Its pass acts only on groups with symmetric memory, so the tp group gets it."""
    if device_type != "cuda" or not compile:
        raise ConfigError(
            "parallel.async_tp=true needs CUDA devices and trainer.compile=true (it is an "
            f"Inductor pass over compiled graphs; here: device {device_type}, compile {compile}); "
            "set parallel.async_tp=false"
        )
    import torch._inductor.config
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
    log.info("async tensor parallelism: Inductor's micro-pipeline pass on the tp group")


def _shorten(names: list[str], shown: int = 6) -> list[str]:
    """Module names for a log line: the first few, then how many more."""
    return names[:shown] + ([f"... {len(names) - shown} more"] if len(names) > shown else [])


def build_model_for(
    request: EngineRequest,
) -> tuple[Transformer, MasterWeights | None, Float8Plan | None]:
    """The model to train (sharded when there are several ranks), with
    trainer.precision=bf16_master in one process its fp32 master copy, and with float8 what
    was converted."""
    dims, device = request.dims, request.device
    meshes = build_meshes(dims, device.type) if dims.world_size > 1 else None
    with torch.device("meta"):
        model = Transformer(request.model_cfg)
    param_dtype = fsdp_param_dtype(request.parallel, request.precision)
    float8 = parallelize(
        model,
        meshes,
        request.parallel,
        param_dtype,
        request.compile,
        device.type,
        float8=request.float8_config,
    )
    model.to_empty(device=device)
    init_like_single_process(model, device, request.seed)
    if request.initial_weights is not None:
        load_weights(model, request.initial_weights())
    master = None
    if meshes is None and request.precision == "bf16_master":
        with torch.device("meta"):
            copy = Transformer(request.model_cfg)
        copy.to_empty(device=device)
        for buffer in copy.buffers():  # the non-persistent ones (statistics) are not loaded
            buffer.zero_()
        master = MasterWeights(model, copy)
    return model, master, float8


@ENGINES.register("fsdp2")
def build_fsdp2(request: EngineRequest) -> FSDP2Engine:
    if request.dims.pp > 1:  # the same engine per stage, under a pipeline schedule
        from parallel.pipeline import build_pipeline

        return build_pipeline(request)
    model, master, float8 = build_model_for(request)
    optimizer = request.make_optimizer(master.master if master is not None else model)
    engine = FSDP2Engine(model, optimizer, request.precision, request.device, master)
    engine.float8 = float8
    return engine
