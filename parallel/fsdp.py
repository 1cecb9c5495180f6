"""FSDP2 (`fully_shard`) over the blocks and the root, with a mixed-precision policy.

Each block is one FSDP unit (its weights gathered just before it runs), the root holds the
embedding, final norm and head. Under expert parallelism the experts of a MoE block are their
own unit on the expert mesh; their gradients arrive summed over the `ep` ranks that sent tokens
(the all-to-all's backward), so the reduce-scatter divides by every data-parallel rank,
not by the expert mesh alone: otherwise expert gradients would grow with the EP degree.
Engram's tables are units of their own too (`_shard_tables`). The MTP modules' blocks are
wrapped like the stack's, then each module (its norms and 2C -> C projection); the embedding and
head they share stay in the root's unit, which is gathered until the loss is done.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from model.errors import ConfigError
from model.roles import EXPERT_STACK, MEMORY, role_owners
from model.transformer import Transformer
from parallel.mesh import Meshes


def mixed_precision(param_dtype: torch.dtype) -> MixedPrecisionPolicy:
    """Gather and compute in `param_dtype`, reduce gradients in fp32 (sharded fp32 masters)."""
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


FP32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)


def _shard_fp32_parts(
    module: nn.Module, mesh, reshard_after_forward: bool, tables: list[nn.Module]
) -> None:
    """Modules that keep their parameters fp32 (`keep_fp32`: AttnRes' pseudo-queries, mHC's maps)
    become FSDP2 units of their own that gather and compute in fp32 under any param_dtype."""
    skip = {id(table) for table in tables}  # their own unit already, or replicated
    for part in module.modules():
        if isinstance(part, FSDPModule) or id(part) in skip:
            continue
        if getattr(part, "keep_fp32", False) and any(True for _ in part.parameters(recurse=False)):
            fully_shard(
                part, mesh=mesh, mp_policy=FP32, reshard_after_forward=reshard_after_forward
            )


def memory_tables(model: nn.Module) -> list[nn.Module]:
    """The lookup tables read a few rows per token (parameter role `memory`: Engram's). Each
    declares `sharding` ("rows" | "replicated"), `offload` (bool) and `sparse_grad` (bool)."""
    return role_owners(model, MEMORY)


def replicated_tables(model: nn.Module) -> list[nn.Module]:
    """Memory tables every rank holds whole (model.engram.sharding=replicated)."""
    return [table for table in memory_tables(model) if table.sharding == "replicated"]


def _shard_tables(
    tables: list[nn.Module], mesh, reshard_after_forward: bool, recompute: bool
) -> None:
    """Memory tables (Engram's, sharding=rows): FSDP2 units of their own, sharded by rows (dim 0) and
    gathered in fp32, with dense gradients (FSDP2 reduce-scatters dense tensors; row-wise Adam
    finds the rows read, optim/row_adam.py); not gathered again for backward (a lookup's backward
    does not read the table) unless activation checkpointing recomputes the lookup there.
    Replicated tables stay out of FSDP2 with their sparse gradients (averaged over the ranks by
    the engine: parallel/sparse_sync.py). Host-memory tables (offload) are refused here."""
    for part in tables:
        if part.offload:
            raise ConfigError(
                "model.engram.offload=true keeps the tables in one process's host memory; it "
                "does not work with several ranks (data- or tensor-parallel) yet: set "
                "model.engram.offload=false"
            )
        if part.sharding == "replicated":
            continue
        part.sparse_grad = False
        fully_shard(part, mesh=mesh, mp_policy=FP32, reshard_after_forward=reshard_after_forward)
        if not recompute:
            part.set_unshard_in_backward(False)


def apply_fsdp(
    model: Transformer,
    meshes: Meshes,
    mp: MixedPrecisionPolicy,
    reshard_after_forward: bool,
    recompute: bool = False,
) -> None:
    """`recompute`: activation checkpointing recomputes the blocks in backward."""
    tables = memory_tables(model)
    stacks = role_owners(model, EXPERT_STACK)  # the routed experts' weights, one unit each
    ignored = {p for table in replicated_tables(model) for p in table.parameters(recurse=False)}
    for block in model.blocks():
        inside = {id(part) for part in block.modules()}
        _shard_tables(
            [t for t in tables if id(t) in inside], meshes.dense, reshard_after_forward, recompute
        )
        if mp.param_dtype not in (None, torch.float32):
            _shard_fp32_parts(block, meshes.dense, reshard_after_forward, tables)
        for experts in [s for s in stacks if id(s) in inside and meshes.experts is not None]:
            fully_shard(
                experts,
                mesh=meshes.experts,
                mp_policy=mp,
                reshard_after_forward=reshard_after_forward,
                shard_placement_fn=_expert_placement(meshes.dims.expert_shard * meshes.dims.cp),
            )
            # every rank's tokens reach the experts (the cp ranks' too: their losses average)
            experts.set_gradient_divide_factor(float(meshes.dims.dp_ranks * meshes.dims.cp))
            if meshes.dims.expert_shard * meshes.dims.cp > 1:  # (the experts' shard ranks)
                # reduce with SUM, then divide: a pre-scaled sum (PREMUL_SUM) has no gloo version.
                # (Not when the reduce-scatter has 1 rank, also under HSDP: there FSDP divides
                # without a collective, and forcing the sum would divide twice.)
                experts.set_force_sum_reduction_for_comms(True)
        fully_shard(
            block,
            mesh=meshes.dense,
            mp_policy=mp,
            reshard_after_forward=reshard_after_forward,
            ignored_params=ignored,
        )
    if model.mtp is not None:  # each module's norms and projection with its block's unit
        for module in model.mtp.layers:
            fully_shard(
                module, mesh=meshes.dense, mp_policy=mp, reshard_after_forward=reshard_after_forward
            )
    if mp.param_dtype not in (None, torch.float32):
        _shard_fp32_parts(model.stream, meshes.dense, False, tables)
    # the root's weights (embedding, head) are needed again at once by the loss: keep them
    fully_shard(
        model, mesh=meshes.dense, mp_policy=mp, reshard_after_forward=False, ignored_params=ignored
    )


def _expert_placement(shards: int):
    """Shard expert weights (E_local, ...) on dim 0 when there are enough local experts for
    every shard, else on dim 1 (fine-grained experts with few per rank)."""

    def placement(param: torch.nn.Parameter) -> Shard:
        local_experts = param.to_local().shape[0] if hasattr(param, "to_local") else param.shape[0]
        return Shard(0) if local_experts >= shards else Shard(1)

    return placement
