"""Newton-Schulz on sharded matrices: each matrix is orthogonalized once, whole, on one rank.

With FSDP2 every rank holds a shard of every matrix, but Newton-Schulz needs the whole matrix.
The matrices are dealt out in rounds to owner ranks: an owner gathers its matrix's row shards
(in bf16, the dtype Newton-Schulz computes in) from the ranks of its shard group,
orthogonalizes it, and scatters the result back as shards. Layouts:

- FSDP (1-D mesh, Shard(0)): a round is P matrices, one per rank of the mesh.
- HSDP (replicate x shard, [Replicate, Shard(0)]): a round is R x P matrices. Matrix m of the
  round belongs to replica m // P and there to shard rank m % P; the replica's shard group
  gathers and scatters it, then each shard is broadcast over the replicate group. Every matrix
  is still orthogonalized once in the whole job.
- Expert stacks (E, in, out) split along E only (EP and/or FSDP on dim 0): every local expert is
  whole, so Newton-Schulz runs locally, per expert, with no communication.
- Expert stacks split inside each expert (FSDP on dim 1, when there are fewer local experts
  than shard ranks): every local expert is one matrix whose rows are sharded; dealt out as above.
- Anything else falls back to gathering the whole tensor on every rank (correct, redundant).

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
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from optim import newton_schulz
from optim.newton_schulz import orthogonalize_many

NS = Callable[[Tensor], Tensor]  # whole matrix (or expert stack) -> orthogonalized, bf16
work: Counter[str] = Counter()  # "local", "owned", "fallback": matrices orthogonalized here


def orthogonalize_all(updates: list[Tensor], ns: list[NS]) -> list[Tensor]:
    """ns[i](updates[i]) for each update, in the update's own layout (DTensor shards stay
    shards), with the work divided among ranks as the module docstring describes."""
    out: list[Tensor | None] = [None] * len(updates)
    by_layout: dict[tuple, list[int]] = {}
    local: list[int] = []  # whole on this rank: orthogonalized here, batched by shape
    for i, u in enumerate(updates):
        if not isinstance(u, DTensor):
            local.append(i)
            work["local"] += 1
        elif u.ndim == 3 and _whole_experts(u):
            local.append(i)
            work["local"] += u.to_local().shape[0]
        elif (layout := _owner_layout(u)) is not None:  # meshes compare by value: FSDP2
            by_layout.setdefault((u.device_mesh, layout), []).append(i)  # makes one per param
        else:
            out[i] = _local_piece(ns[i](u.full_tensor()), u)
            work["fallback"] += 1
    pieces = [u.to_local() if isinstance(u, DTensor) else u for u in (updates[i] for i in local)]
    for i, result in zip(local, orthogonalize_many(pieces, [ns[i] for i in local])):
        out[i] = _rewrap(result, updates[i]) if isinstance(updates[i], DTensor) else result
    first_owner = 0  # rotates, so that partial rounds do not all start on the same rank
    for (_, layout), indices in by_layout.items():
        owned, first_owner = _owner_orthogonalize(
            [updates[i] for i in indices], [ns[i] for i in indices], layout, first_owner
        )
        for i, result in zip(indices, owned):
            out[i] = result
    return out  # type: ignore[return-value]


@dataclass(frozen=True)
class _OwnerLayout:
    shard_dim: int | None  # mesh dim whose ranks hold the row shards; None: no sharding
    replicate_dim: int | None  # mesh dim of identical replicas (HSDP), if any
    experts: bool  # a (E, in, out) stack split on dim 1: each local expert is one matrix


def _owner_layout(u: DTensor) -> _OwnerLayout | None:
    """The layout the owner path handles, or None (fallback). Size-1 mesh dims are ignored."""
    row_dim = 1 if u.ndim == 3 else 0
    shard_dims, replicate_dims = [], []
    for mesh_dim, placement in enumerate(u.placements):
        if u.device_mesh.size(mesh_dim) == 1:
            continue
        if placement.is_replicate():
            replicate_dims.append(mesh_dim)
        elif type(placement) is Shard and placement.dim == row_dim:
            shard_dims.append(mesh_dim)
        elif not (u.ndim == 3 and _shard_dim(placement) == 0):  # splitting E: experts stay whole
            return None
    if u.ndim not in (2, 3) or len(shard_dims) > 1 or len(replicate_dims) > 1:
        return None
    if not shard_dims and not replicate_dims:
        return None
    shard = shard_dims[0] if shard_dims else None  # None: whole on every rank (replicated)
    replicate = replicate_dims[0] if replicate_dims else None
    return _OwnerLayout(shard, replicate, experts=u.ndim == 3)


def _shard_dim(placement) -> int | None:
    """The tensor dim a placement splits (Shard or FSDP2's _StridedShard under EP), else None."""
    if placement.is_shard() or type(placement).__name__ == "_StridedShard":
        return placement.dim
    return None


def _whole_experts(u: DTensor) -> bool:
    """An expert stack (E, in, out) split only along E (by EP, and by FSDP when there are enough
    local experts): every local expert is complete."""
    return all(p.is_replicate() or _shard_dim(p) == 0 for p in u.placements)


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
    """One matrix of the owner path: this rank's row shard, padded to the even chunk."""

    shard: Tensor  # (ceil(rows / P), cols) bf16
    rows: int  # the whole matrix's rows
    local_rows: int  # rows of the real (unpadded) shard
    ns: NS


def _items(u: DTensor, ns: NS, size: int) -> list[_Item]:
    local = u.to_local()
    if u.ndim == 2:
        return [_Item(_padded(local, u.shape[0], size), u.shape[0], local.shape[0], ns)]
    return [_Item(_padded(e, u.shape[1], size), u.shape[1], e.shape[0], ns) for e in local]


def _padded(local: Tensor, rows: int, size: int) -> Tensor:
    """A dim-0 shard in bf16, zero-padded to FSDP2's shard size ceil(rows / P)."""
    padded = local.new_zeros((-(-rows // size), *local.shape[1:]), dtype=torch.bfloat16)
    padded[: local.shape[0]] = local
    return padded


class _Groups:
    """This rank's shard group and replicate group (either may be absent) for one layout."""

    def __init__(self, mesh, layout: _OwnerLayout) -> None:
        me = dist.get_rank()
        self.shard = None if layout.shard_dim is None else mesh.get_group(layout.shard_dim)
        self.shard_ranks = [me] if self.shard is None else dist.get_process_group_ranks(self.shard)
        self.me = self.shard_ranks.index(me)
        self.replicate = (
            None if layout.replicate_dim is None else mesh.get_group(layout.replicate_dim)
        )
        self.replica_ranks = (
            [me] if self.replicate is None else dist.get_process_group_ranks(self.replicate)
        )
        self.my_replica = self.replica_ranks.index(me)
        self.per_round = len(self.shard_ranks) * len(self.replica_ranks)


def _owner_orthogonalize(
    updates: list[DTensor], ns: list[NS], layout: _OwnerLayout, first_owner: int
) -> tuple[list[Tensor], int]:
    """Every matrix of these updates orthogonalized once; returns the results (as the updates'
    DTensors) and the owner slot where the next layout should start."""
    groups = _Groups(updates[0].device_mesh, layout)
    size = len(groups.shard_ranks)
    items = [item for u, f in zip(updates, ns) for item in _items(u, f, size)]
    largest = max(item.shard.numel() * size for item in items)  # a whole matrix, padded
    rounds = max(1, newton_schulz.BATCH_ELEMENTS // largest)  # each owner: one matrix a round
    wave = groups.per_round * rounds
    pieces: list[Tensor] = []
    for first in range(0, len(items), wave):  # first % per_round == 0: the owners stay put
        batch = items[first : first + wave]
        pieces += _round(batch, groups, first_owner)
    results, used = [], 0
    for u in updates:
        count = 1 if u.ndim == 2 else u.to_local().shape[0]
        mine = [p[: item.local_rows] for p, item in zip(pieces[used : used + count], items[used:])]
        used += count
        results.append(_rewrap(mine[0] if u.ndim == 2 else torch.stack(mine), u))
    return results, (first_owner + len(items)) % groups.per_round


def _round(items: list[_Item], g: _Groups, offset: int) -> list[Tensor]:
    """A wave of rounds: item m takes owner slot s = (m + offset) mod R*P, that is replica
    s // P and there shard rank s % P. All gathers are in flight at once, then each owner
    orthogonalizes its matrices (batched by shape), then all scatters and broadcasts."""
    size = len(g.shard_ranks)
    owner = [divmod((m + offset) % g.per_round, size) for m in range(len(items))]
    ours = [m for m, (replica, _) in enumerate(owner) if replica == g.my_replica]
    gathered = {m: _gather(items[m].shard, owner[m][1], g) for m in ours}
    gathered = {m: _wait(value) for m, value in gathered.items()}
    send: dict[int, list[Tensor]] = {}
    mine = [m for m in ours if owner[m][1] == g.me]
    whole = [torch.cat(gathered.pop(m))[: items[m].rows] for m in mine]  # shards freed
    for m, ortho in zip(mine, orthogonalize_many(whole, [items[m].ns for m in mine])):
        ortho = ortho.bfloat16()
        padding = ortho.new_zeros(
            (items[m].shard.shape[0] * size - items[m].rows, *ortho.shape[1:])
        )
        send[m] = list(torch.cat([ortho, padding]).chunk(size))
        work["owned"] += 1
    received = [torch.empty_like(item.shard) for item in items]
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
    if g.replicate is not None:  # every replica gets each shard from the replica that made it
        handles = [
            dist.broadcast(
                received[m], src=g.replica_ranks[replica], group=g.replicate, async_op=True
            )
            for m, (replica, _) in enumerate(owner)
        ]
        for handle in handles:
            handle.wait()
    return received


def _gather(shard: Tensor, owner: int, g: _Groups):
    """Start gathering a matrix's shards onto its owner: (list to fill or None, handle)."""
    if g.shard is None:
        return [shard], None
    target = [torch.empty_like(shard) for _ in g.shard_ranks] if owner == g.me else None
    handle = dist.gather(shard, target, dst=g.shard_ranks[owner], group=g.shard, async_op=True)
    return target, handle


def _wait(pending):
    target, handle = pending
    if handle is not None:
        handle.wait()
    return target
