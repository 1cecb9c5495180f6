"""Device mesh, FSDP2, expert parallelism, activation checkpointing and compile.

Applied from outside to a plain `model.Transformer` built on the meta device, in a fixed order:
expert parallelism -> activation checkpointing -> compile (per block) -> FSDP2. Then the trainer
allocates the shards (`to_empty`) and fills them (`parallel.init.init_like_single_process`).
"""

from __future__ import annotations

import torch

from model.transformer import Transformer
from parallel.activation import apply_activation_checkpointing, compile_blocks
from parallel.config import ParallelConfig
from parallel.fsdp import apply_fsdp, mixed_precision
from parallel.mesh import Meshes


def fsdp_param_dtype(cfg: ParallelConfig, precision: str) -> torch.dtype:
    """`parallel.param_dtype=auto`: bf16 gathers/compute unless the trainer computes in fp32."""
    if cfg.param_dtype == "auto":
        return torch.float32 if precision == "fp32" else torch.bfloat16
    return torch.bfloat16 if cfg.param_dtype == "bf16" else torch.float32


def parallelize(
    model: Transformer,
    meshes: Meshes,
    cfg: ParallelConfig,
    param_dtype: torch.dtype,
    compile_model: bool,
) -> None:
    """Rewrite `model` (on the meta device) in place for the mesh."""
    if meshes.ep is not None:
        from parallel.expert_parallel import apply_expert_parallel

        apply_expert_parallel(model, meshes.ep)
    apply_activation_checkpointing(model, cfg.activation_checkpoint)
    if compile_model:
        compile_blocks(model)
    apply_fsdp(model, meshes, mixed_precision(param_dtype), cfg.reshard_after_forward)
