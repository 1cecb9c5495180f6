"""Newton-Schulz on sharded matrices: each matrix is orthogonalized once, whole, on one rank.

With FSDP2 (and tensor parallelism) every rank holds a piece of every matrix, but Newton-Schulz
needs the whole matrix. The matrices are dealt out in rounds to owner ranks: an owner gathers
its matrix's pieces (in bf16, the dtype Newton-Schulz computes in) from the ranks of its gather
group, orthogonalizes it, and scatters the result back as pieces. A piece is whatever the
DTensor's placements give a rank (row shards, column shards, blocks, _StridedShard rows):
the rows and columns of each rank's piece are computed with DTensor's own split rules, so the
assembled matrix is the one `full_tensor()` would give. Layouts:

- FSDP (1-D mesh, Shard(0)): a round is P matrices, one per rank of the mesh.
- Tensor parallelism + FSDP2 ((dp_shard, tp) mesh: column-wise weights (_StridedShard(0),
  Shard(0)), row-wise ones (Shard(0), Shard(1))): the gather group is every rank of the sharded
  mesh dims (flattened: dp_shard x tp ranks), a round is dp_shard x tp matrices, and each is
  orthogonalized once in the whole job.
- Replicas (HSDP's [Replicate, Shard(0)], tp's Replicate of head-shared weights): a round is
  R x P matrices. Matrix m of the round belongs to replica m // P and there to gather rank
  m % P; the replica's gather group gathers and scatters it, then each piece is broadcast over
  the replicate group. Every matrix is still orthogonalized once in the whole job. A weight
  that tensor parallelism leaves whole on every tp rank (FSDP2 shards it over the data ranks
  only, on a mesh without the root's "tp" dim) is treated as replicated over tp.
- Expert stacks (E, in, out) split along E only (EP and/or FSDP on dim 0): every local expert is
  whole, so Newton-Schulz runs locally, per expert, with no communication.
- Expert stacks split inside each expert (FSDP on dim 1, when there are fewer local experts
  than shard ranks): every local expert is one matrix whose rows are sharded; dealt out as above.
- Anything else (Partial placements, several sharded or replicated mesh dims on a mesh without
  dim names) falls back to gathering the whole tensor on every rank (correct, redundant).

Same-shaped matrices are orthogonalized as one batch (optim.newton_schulz.orthogonalize_many):
the local ones together, and an owner's matrices of several rounds together (a wave of rounds
holds at most BATCH_ELEMENTS whole-matrix elements per owner).

The result equals single-process Muon bitwise on CPU (tested): the same full matrix goes
through the same iteration, batched with other same-shaped matrices (on GPUs the batched GEMMs
may pick other kernels for other batch sizes: equal to rounding). `work` counts the matrices
this process orthogonalized (tests check the division).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from optim import newton_schulz
from optim.matrix_pieces import Plan, plan_pieces, shard_dim
from optim.newton_schulz import orthogonalize_many

NS = Callable[[Tensor], Tensor]  # whole matrix (or expert stack) -> orthogonalized, bf16
work: Counter[str] = Counter()  # "local", "owned", "fallback": matrices orthogonalized here
TP = "tp"  # the root mesh dim of tensor parallelism (parallel/mesh.py names it so)


def orthogonalize_all(updates: list[Tensor], ns: list[NS]) -> list[Tensor]:
    """ns[i](updates[i]) for each update, in the update's own layout (DTensor shards stay
    shards), with the work divided among ranks as the module docstring describes."""
    out: list[Tensor | None] = [None] * len(updates)
    by_layout: dict[tuple, list[int]] = {}
    viewed: dict[int, DTensor] = {}  # the updates as the owner path sees them (tp added)
    local: list[int] = []  # whole on this rank: orthogonalized here, batched by shape
    for i, u in enumerate(updates):
        if not isinstance(u, DTensor):
            local.append(i)
            work["local"] += 1
        elif u.ndim == 3 and _whole_experts(u):
            local.append(i)
            work["local"] += u.to_local().shape[0]
        elif (layout := _owner_layout(view := _with_tp(u))) is not None:
            viewed[i] = view  # meshes compare by value: FSDP2 makes one per param
            by_layout.setdefault((view.device_mesh, layout), []).append(i)
        else:
            out[i] = _local_piece(ns[i](u.full_tensor()), u)
            work["fallback"] += 1
    pieces = [u.to_local() if isinstance(u, DTensor) else u for u in (updates[i] for i in local)]
    for i, result in zip(local, orthogonalize_many(pieces, [ns[i] for i in local])):
        out[i] = _rewrap(result, updates[i]) if isinstance(updates[i], DTensor) else result
    first_owner = 0  # rotates, so that partial rounds do not all start on the same rank
    for (_, layout), indices in by_layout.items():
        owned, first_owner = _owner_orthogonalize(
            [viewed[i] for i in indices], [ns[i] for i in indices], layout, first_owner
        )
        for i, result in zip(indices, owned):
            out[i] = _rewrap(result, updates[i])
    return out  # type: ignore[return-value]


@dataclass(frozen=True)
class _OwnerLayout:
    gather_dims: tuple[int, ...]  # mesh dims whose ranks hold pieces of each matrix
    replicate_dims: tuple[int, ...]  # mesh dims of identical copies (HSDP replicas, tp)


def _owner_layout(u: DTensor) -> _OwnerLayout | None:
    """The layout the owner path handles, or None (fallback). Size-1 mesh dims are ignored."""
    first = 1 if u.ndim == 3 else 0  # the matrix dims: (0, 1), or each expert's (1, 2)
    gather, replicate = [], []
    for mesh_dim, placement in enumerate(u.placements):
        dim = shard_dim(placement)
        if u.device_mesh.size(mesh_dim) == 1:
            continue
        if placement.is_replicate():
            replicate.append(mesh_dim)
        elif dim is not None and dim >= first:
            gather.append(mesh_dim)
        elif not (first == 1 and dim == 0):  # splitting E: experts stay whole
            return None
    if u.ndim not in (2, 3) or not (gather or replicate):
        return None
    if max(len(gather), len(replicate)) > 1 and u.device_mesh.mesh_dim_names is None:
        return None  # several dims are flattened into one group by name
    return _OwnerLayout(tuple(gather), tuple(replicate))


def _whole_experts(u: DTensor) -> bool:
    """An expert stack (E, in, out) split only along E (by EP, and by FSDP when there are enough
    local experts): every local expert is complete."""
    return all(p.is_replicate() or shard_dim(p) == 0 for p in u.placements)


def _with_tp(u: DTensor) -> DTensor:
    """u, or u on its root mesh with the root's tp dim added as Replicate when u's mesh lacks
    it: tensor parallelism leaves such a weight whole on every tp rank (FSDP2 shards it over
    the data ranks only), so the tp ranks hold identical copies and share its work as replicas
    do. The same local tensor: no copy, no communication."""
    mesh, names = u.device_mesh, u.device_mesh.mesh_dim_names
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    root_names = root.mesh_dim_names
    if names is None or root_names is None or TP not in root_names or TP in names:
        return u
    if root.size(root_names.index(TP)) == 1 or not set(names) <= set(root_names):
        return u
    order = tuple(n for n in root_names if n in names or n == TP)
    placements = [u.placements[names.index(n)] if n in names else Replicate() for n in order]
    return DTensor.from_local(
        u.to_local(), root[order], placements, run_check=False, shape=u.shape, stride=u.stride()
    )


def _rewrap(local: Tensor, like: DTensor) -> DTensor:
    return DTensor.from_local(
        local.to(like.dtype),
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def _local_piece(full: Tensor, like: DTensor) -> Tensor:
    """This rank's piece of `full` (whole on every rank) in `like`'s layout, as a DTensor."""
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)


@dataclass
class _Item:
    """One matrix of the owner path: this rank's piece, flat, padded to the plan's size."""

    piece: Tensor  # (plan.size,) bf16
    local_shape: tuple[int, ...]  # of the real piece
    plan: Plan
    ns: NS


def _items(u: DTensor, ns: NS, g: _Groups) -> list[_Item]:
    local = u.to_local()
    plan = plan_pieces(
        tuple(u.shape), tuple(u.device_mesh.shape), tuple(u.placements), g.coordinates
    )
    matrices = [local] if u.ndim == 2 else list(local)
    return [_Item(_flat(m, plan.size), tuple(m.shape), plan, ns) for m in matrices]


def _flat(piece: Tensor, size: int) -> Tensor:
    """A piece in bf16, flattened and zero-padded to `size` elements (equal on every rank)."""
    flat = piece.new_zeros(size, dtype=torch.bfloat16)
    flat[: piece.numel()] = piece.reshape(-1)
    return flat


class _Groups:
    """This rank's gather group and replicate group (either may be absent) for one layout,
    and the mesh coordinates of the gather group's ranks (in group order)."""

    def __init__(self, mesh, layout: _OwnerLayout) -> None:
        me = dist.get_rank()
        self.shard = _group(mesh, layout.gather_dims)
        self.shard_ranks = [me] if self.shard is None else dist.get_process_group_ranks(self.shard)
        self.me = self.shard_ranks.index(me)
        self.coordinates = tuple(
            tuple(int(c) for c in (mesh.mesh == rank).nonzero()[0]) for rank in self.shard_ranks
        )
        self.replicate = _group(mesh, layout.replicate_dims)
        self.replica_ranks = (
            [me] if self.replicate is None else dist.get_process_group_ranks(self.replicate)
        )
        self.my_replica = self.replica_ranks.index(me)
        self.per_round = len(self.shard_ranks) * len(self.replica_ranks)


def _group(mesh, dims: tuple[int, ...]):
    """The process group of the ranks that differ only along these mesh dims (several dims:
    their flattened mesh, which the root mesh creates once and keeps)."""
    if not dims:
        return None
    if len(dims) == 1:
        return mesh.get_group(dims[0])
    names = tuple(mesh.mesh_dim_names[d] for d in dims)
    return mesh[names]._flatten().get_group()


def _owner_orthogonalize(
    updates: list[DTensor], ns: list[NS], layout: _OwnerLayout, first_owner: int
) -> tuple[list[Tensor], int]:
    """Every matrix of these updates orthogonalized once; returns this rank's pieces of the
    results (local tensors, bf16) and the owner slot where the next layout should start."""
    groups = _Groups(updates[0].device_mesh, layout)
    size = len(groups.shard_ranks)
    items = [item for u, f in zip(updates, ns) for item in _items(u, f, groups)]
    largest = max(item.plan.size * size for item in items)  # a whole matrix, padded
    rounds = max(1, newton_schulz.BATCH_ELEMENTS // largest)  # each owner: one matrix a round
    wave = groups.per_round * rounds
    pieces: list[Tensor] = []
    for first in range(0, len(items), wave):  # first % per_round == 0: the owners stay put
        batch = items[first : first + wave]
        pieces += _round(batch, groups, first_owner)
    results, used = [], 0
    for u in updates:
        count = 1 if u.ndim == 2 else u.to_local().shape[0]
        mine = [
            p[: _numel(item.local_shape)].view(item.local_shape)
            for p, item in zip(pieces[used : used + count], items[used:])
        ]
        used += count
        results.append(mine[0] if u.ndim == 2 else torch.stack(mine))
    return results, (first_owner + len(items)) % groups.per_round


def _numel(shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape).numel())


def _round(items: list[_Item], g: _Groups, offset: int) -> list[Tensor]:
    """A wave of rounds: item m takes owner slot s = (m + offset) mod R*P, that is replica
    s // P and there gather rank s % P. All gathers are in flight at once, then each owner
    orthogonalizes its matrices (batched by shape), then all scatters and broadcasts."""
    size = len(g.shard_ranks)
    owner = [divmod((m + offset) % g.per_round, size) for m in range(len(items))]
    ours = [m for m, (replica, _) in enumerate(owner) if replica == g.my_replica]
    gathered = {m: _gather(items[m].piece, owner[m][1], g) for m in ours}
    gathered = {m: _wait(value) for m, value in gathered.items()}
    send: dict[int, list[Tensor]] = {}
    mine = [m for m in ours if owner[m][1] == g.me]
    whole = [_assemble(gathered.pop(m), items[m].plan) for m in mine]  # pieces freed
    for m, ortho in zip(mine, orthogonalize_many(whole, [items[m].ns for m in mine])):
        plan = items[m].plan
        send[m] = [_flat(plan.take(ortho.bfloat16(), j), plan.size) for j in range(size)]
        work["owned"] += 1
    received = [torch.empty_like(item.piece) for item in items]
    handles = []
    for m in ours:
        if g.shard is None:
            received[m] = send[m][0]
        else:
            src = g.shard_ranks[owner[m][1]]
            handles.append(
                dist.scatter(received[m], send.get(m), src=src, group=g.shard, async_op=True)
            )
    for handle in handles:
        handle.wait()
    if g.replicate is not None:  # every replica gets each piece from the replica that made it
        handles = [
            dist.broadcast(
                received[m], src=g.replica_ranks[replica], group=g.replicate, async_op=True
            )
            for m, (replica, _) in enumerate(owner)
        ]
        for handle in handles:
            handle.wait()
    return received


def _assemble(pieces: list[Tensor], plan: Plan) -> Tensor:
    """The whole matrix from every gather-group rank's piece (flat, padded)."""
    whole = pieces[0].new_empty(plan.shape)
    for member, flat in enumerate(pieces):
        plan.put(whole, member, flat)
    return whole


def _gather(piece: Tensor, owner: int, g: _Groups):
    """Start gathering a matrix's pieces onto its owner: (list to fill or None, handle)."""
    if g.shard is None:
        return [piece], None
    target = [torch.empty_like(piece) for _ in g.shard_ranks] if owner == g.me else None
    handle = dist.gather(piece, target, dst=g.shard_ranks[owner], group=g.shard, async_op=True)
    return target, handle


def _wait(pending):
    target, handle = pending
    if handle is not None:
        handle.wait()
    return target
