"""Newton-Schulz on sharded matrices: each matrix is orthogonalized once, whole, on one rank.

With FSDP2 every rank holds a dim-0 shard of every matrix, but Newton-Schulz needs the whole
matrix. For matrices sharded on dim 0 over a 1-D mesh (FSDP), matrix i is gathered onto rank
i mod P of that mesh, orthogonalized there, and scattered back as shards: each rank does 1/P of
the Newton-Schulz work, and the communication is one gather and one scatter of each matrix
(the same volume as the all-gather that FSDP's forward needs). Other layouts (HSDP, expert
meshes) fall back to gathering the matrix on every rank (correct, but every rank computes it).
Plain tensors are orthogonalized in place of the call.

The result equals single-process Muon: the same full matrix goes through the same iteration.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard

from optim.newton_schulz import orthogonalize

Coefficients = list[tuple[float, float, float]]


def orthogonalize_all(updates: list[Tensor], coefficients: Coefficients) -> list[Tensor]:
    """NS(update) for each update, in the update's own layout (DTensor shards stay shards)."""
    out: list[Tensor | None] = [None] * len(updates)
    by_mesh: dict[int, list[int]] = {}
    for i, u in enumerate(updates):
        if not isinstance(u, DTensor):
            out[i] = orthogonalize(u, coefficients)
        elif u.device_mesh.ndim == 1 and u.placements == (Shard(0),):
            by_mesh.setdefault(id(u.device_mesh), []).append(i)
        else:
            full = orthogonalize(u.full_tensor(), coefficients)
            out[i] = _local_piece(full, u)
    for indices in by_mesh.values():
        for i, result in zip(
            indices, _owner_orthogonalize([updates[i] for i in indices], coefficients)
        ):
            out[i] = result
    return out  # type: ignore[return-value]


def _local_piece(full: Tensor, like: DTensor) -> Tensor:
    """This rank's piece of `full` in `like`'s layout, as a DTensor."""
    replicated = DTensor.from_local(
        full, like.device_mesh, [Replicate()] * like.device_mesh.ndim, run_check=False
    )
    return replicated.redistribute(like.device_mesh, like.placements)


def _owner_orthogonalize(updates: list[DTensor], coefficients: Coefficients) -> list[Tensor]:
    mesh = updates[0].device_mesh
    group, size, me = mesh.get_group(), mesh.size(), mesh.get_local_rank()
    ranks = dist.get_process_group_ranks(group)
    results = []
    for i, u in enumerate(updates):
        owner = i % size
        rows = u.shape[0]
        chunk = -(-rows // size)  # FSDP2's dim-0 shard size (the last ones may be shorter)
        local = u.to_local()
        padded = local.new_zeros((chunk, *local.shape[1:]))
        padded[: local.shape[0]] = local
        pieces = [torch.empty_like(padded) for _ in range(size)] if me == owner else None
        dist.gather(padded, pieces, dst=ranks[owner], group=group)
        if me == owner:
            full = torch.cat(pieces)[:rows]  # type: ignore[arg-type]
            ortho = orthogonalize(full, coefficients).to(local.dtype)
            ortho = torch.cat([ortho, ortho.new_zeros((chunk * size - rows, *ortho.shape[1:]))])
            send = list(ortho.chunk(size))
        else:
            send = None
        received = torch.empty_like(padded)
        dist.scatter(received, send, src=ranks[owner], group=group)
        piece = received[: local.shape[0]]
        results.append(
            DTensor.from_local(
                piece, mesh, u.placements, run_check=False, shape=u.shape, stride=u.stride()
            )
        )
    return results
