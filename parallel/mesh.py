"""The device mesh from `parallel.*` and the world size.

Dense weights live on `dp_replicate x dp_shard` (DDP-like replication, FSDP2 sharding, or both:
HSDP). Expert parallelism borrows its ranks from `dp_shard`: the shard dimension is split into
`dp_shard / ep` groups of `ep` ranks, experts are divided over the `ep` ranks of a group, and
each expert's weights are sharded over the `dp_shard / ep` groups (and replicated over
`dp_replicate`). All of it is one root mesh

    ("dp_replicate", "dp_shard_mod_ep", "ep")   with "dp_shard" = flatten(dp_shard_mod_ep, ep)

so that FSDP2 can compose the expert mesh with the expert-parallel one (same root); the dense
mesh is built on its own (a mesh whose dim is a flattened pair of another is being deprecated).

Tensor parallelism adds the innermost dimension: the root is ("dp_replicate", "dp_shard", "tp"),
consecutive ranks form a tp group (they share a node and its fast links), FSDP2 shards over the
data-parallel sub-mesh of that root (the 2D/3D composition needs one root), and a rank's
data-parallel index is rank // tp (its tp group reads the same batch rows). With expert
parallelism too, that root's dp_shard is unflattened into (dp_shard_mod_ep, ep): the experts
live on the same root as the dense weights, and each tp rank has its own group of ep ranks.

Context parallelism adds a dimension between the data-parallel ones and tp: the root is
("dp_replicate", "dp_shard", "cp", "tp"). The cp ranks of a group read the same rows and each
computes its part of every sequence; FSDP2 shards the dense weights over flatten(dp_shard, cp)
("dp_shard_cp", as torchtitan), so the cp ranks hold shards, not copies, and the gradient
reduction averages over them (their losses average to the sequence's). With expert parallelism,
dp_shard is unflattened into (dp_shard_mod_ep, ep) and each expert's weights are sharded over
flatten(dp_shard_mod_ep, cp): each cp rank has its own group of ep ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from model.errors import ConfigError
from parallel.config import ParallelConfig


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    ep: int
    world_size: int
    tp: int = 1  # tensor-parallel ranks (innermost: consecutive ranks)
    cp: int = 1  # context-parallel ranks (next to tp: they exchange keys and values per layer)
    pp: int = 1  # pipeline-parallel ranks (outermost: each runs its stages of the stack)

    @classmethod
    def resolve(cls, cfg: ParallelConfig, world_size: int) -> ParallelDims:
        """Fill in dp_shard=-1 and check that the sizes multiply to the world size."""
        tp, cp, pp, shard = cfg.tp, cfg.cp, cfg.pp, cfg.dp_shard
        others = [("pp", pp), ("dp_replicate", cfg.dp_replicate), ("cp", cp), ("tp", tp)]
        others = [(name, size) for name, size in others if size > 1 or name == "dp_replicate"]
        if shard == -1:
            shard, rest = divmod(world_size, pp * cfg.dp_replicate * cp * tp)
            if rest or shard == 0:
                sizes = " x ".join(f"parallel.{name}={size}" for name, size in others)
                product = pp * cfg.dp_replicate * cp * tp
                sizes += f" = {product}" if len(others) > 1 else ""
                raise ConfigError(
                    f"{sizes} does not divide the world size {world_size} (WORLD_SIZE from "
                    "torchrun/srun)"
                )
        if pp * cfg.dp_replicate * shard * cp * tp != world_size:
            at = 1 if pp > 1 else 0  # dp_shard after dp_replicate
            sizes = [*others[: at + 1], ("dp_shard", shard), *others[at + 1 :]]
            product = " x ".join(f"parallel.{name}={size}" for name, size in sizes)
            raise ConfigError(
                f"{product} = {pp * cfg.dp_replicate * shard * cp * tp} ranks, but the world "
                f"size is {world_size}; set parallel.dp_shard=-1 to use all remaining ranks"
            )
        if shard % cfg.ep:
            raise ConfigError(
                f"parallel.ep={cfg.ep} must divide parallel.dp_shard={shard}: expert-parallel "
                "ranks are taken from the sharded data-parallel ones"
            )
        return cls(
            dp_replicate=cfg.dp_replicate,
            dp_shard=shard,
            ep=cfg.ep,
            world_size=world_size,
            tp=tp,
            cp=cp,
            pp=pp,
        )

    @property
    def dp_ranks(self) -> int:
        """Data-parallel ranks: each reads its own rows of the global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def ranks_per_row(self) -> int:
        """Consecutive ranks that read the same batch rows (a cp x tp group)."""
        return self.cp * self.tp

    @property
    def ranks_per_stage(self) -> int:
        """Ranks that run the same pipeline stages (every rank without pipeline parallelism)."""
        return self.world_size // self.pp

    def dp_rank(self, rank: int) -> int:
        """The data-parallel index of global `rank` (the cp x tp ranks of a group share it, and
        the pipeline ranks of a data-parallel index too)."""
        return (rank % self.ranks_per_stage) // self.ranks_per_row

    @property
    def expert_shard(self) -> int:
        """Ranks each expert's weights are sharded over (dp_shard / ep)."""
        return self.dp_shard // self.ep

    def describe(self) -> str:
        parts = [f"world {self.world_size}"]
        parts += [f"pp {self.pp}"] if self.pp > 1 else []
        parts.append(f"dp_shard {self.dp_shard}")
        if self.dp_replicate > 1:
            parts.append(f"dp_replicate {self.dp_replicate} (HSDP)")
        if self.ep > 1:
            parts.append(f"ep {self.ep} (expert weights sharded over {self.expert_shard})")
        if self.cp > 1:
            parts.append(f"cp {self.cp}")
        if self.tp > 1:
            parts.append(f"tp {self.tp}")
        return ", ".join(parts)


@dataclass(frozen=True)
class Meshes:
    dims: ParallelDims
    dense: DeviceMesh  # (dp_replicate, dp_shard) or (dp_shard,): FSDP2/HSDP of dense weights
    experts: DeviceMesh | None  # (dp_replicate, dp_shard_mod_ep) or (dp_shard_mod_ep,), ep > 1
    ep: DeviceMesh | None  # (ep,) when parallel.ep > 1
    tp: DeviceMesh | None = None  # (tp,) when parallel.tp > 1: a sub-mesh of dense's root
    cp: DeviceMesh | None = None  # (cp,) when parallel.cp > 1: a sub-mesh of dense's root
    pp: DeviceMesh | None = None  # (pp,) when parallel.pp > 1: a sub-mesh of dense's root
    # the ranks that run the same stages (flatten(dp_replicate, dp_shard, cp, tp)) when pp > 1
    stage: DeviceMesh | None = None


def build_meshes(dims: ParallelDims, device_type: str) -> Meshes:
    """The meshes over all ranks (the default process group must exist)."""
    if dims.cp > 1 or dims.pp > 1:
        return _context_parallel_meshes(dims, device_type)
    hsdp = dims.dp_replicate > 1
    if dims.tp > 1:  # one root, tp innermost: FSDP2 composes with TP over its sub-meshes
        root = init_device_mesh(
            device_type,
            (dims.dp_replicate, dims.dp_shard, dims.tp),
            mesh_dim_names=("dp_replicate", "dp_shard", "tp"),
        )
        dense = root["dp_replicate", "dp_shard"] if hsdp else root["dp_shard"]
        if dims.ep == 1:
            return Meshes(dims=dims, dense=dense, experts=None, ep=None, tp=root["tp"])
        # experts: dp_shard = dp_shard_mod_ep x ep of the same root (FSDP2 composes them with
        # the dense weights' 2D layout); each tp rank's group of ep ranks exchanges its tokens
        split = root._unflatten("dp_shard", (dims.expert_shard, dims.ep), ("dp_shard_mod_ep", "ep"))
        experts = split["dp_replicate", "dp_shard_mod_ep"] if hsdp else split["dp_shard_mod_ep"]
        return Meshes(dims=dims, dense=dense, experts=experts, ep=split["ep"], tp=root["tp"])
    if hsdp:
        dense = init_device_mesh(
            device_type,
            (dims.dp_replicate, dims.dp_shard),
            mesh_dim_names=("dp_replicate", "dp_shard"),
        )
    else:
        dense = init_device_mesh(device_type, (dims.dp_shard,), mesh_dim_names=("dp_shard",))
    if dims.ep == 1:
        return Meshes(dims=dims, dense=dense, experts=None, ep=None)
    # the expert meshes share one root, as FSDP2 requires to compose them (rank order matches
    # the dense mesh: dp_shard = dp_shard_mod_ep x ep, ep innermost)
    root = init_device_mesh(
        device_type,
        (dims.dp_replicate, dims.expert_shard, dims.ep),
        mesh_dim_names=("dp_replicate", "dp_shard_mod_ep", "ep"),
    )
    experts = root["dp_replicate", "dp_shard_mod_ep"] if hsdp else root["dp_shard_mod_ep"]
    return Meshes(dims=dims, dense=dense, experts=experts, ep=root["ep"])


def _context_parallel_meshes(dims: ParallelDims, device_type: str) -> Meshes:
    """Root (pp, dp_replicate, dp_shard, cp, tp); the weights sharded over dp_shard and cp
    together (the dense ones over flatten(dp_shard, cp), experts over flatten(dp_shard_mod_ep,
    cp)); each pipeline rank's stages over its own sub-meshes."""
    root = init_device_mesh(
        device_type,
        (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp),
        mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"),
    )
    dense = _with_replicas(root, root["dp_shard", "cp"]._flatten("dp_shard_cp"), dims)
    tp = root["tp"] if dims.tp > 1 else None
    cp = root["cp"] if dims.cp > 1 else None
    pipeline = {}
    if dims.pp > 1:
        stage = root["dp_replicate", "dp_shard", "cp", "tp"]._flatten("stage")
        pipeline = {"pp": root["pp"], "stage": stage}
    if dims.ep == 1:
        return Meshes(dims=dims, dense=dense, experts=None, ep=None, tp=tp, cp=cp, **pipeline)
    split = root._unflatten("dp_shard", (dims.expert_shard, dims.ep), ("dp_shard_mod_ep", "ep"))
    experts = split["dp_shard_mod_ep", "cp"]._flatten("dp_shard_mod_ep_cp")
    experts = _with_replicas(split, experts, dims)
    return Meshes(dims=dims, dense=dense, experts=experts, ep=split["ep"], tp=tp, cp=cp, **pipeline)


def _with_replicas(root: DeviceMesh, shards: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """(dp_replicate, shards) under HSDP, else `shards` (a flattened 1-D mesh of `root`)."""
    if dims.dp_replicate == 1:
        return shards
    return DeviceMesh._concatenate([root["dp_replicate"], shards])
