"""Newton-Schulz on sharded matrices: each matrix is orthogonalized once, whole, on one rank.

With FSDP2 every rank holds a dim-0 shard of every matrix, but Newton-Schulz needs the whole
matrix. For matrices sharded on dim 0 over a 1-D mesh (FSDP), each round of P matrices is gathered
(in bf16) onto ranks 0..P-1 of that mesh, one matrix each, orthogonalized there in parallel,
and scattered back as shards: each rank does 1/P of the Newton-Schulz work, and the traffic is
one gather and one scatter of each matrix in bf16. Expert stacks split only along the expert
dim need nothing (Newton-Schulz is per expert and local experts are whole). Other layouts
(HSDP, experts split inside a matrix) fall back to gathering on every rank (correct, redundant).
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
        elif u.ndim == 3 and _whole_experts(u):  # per-expert NS: local experts are whole
            local = orthogonalize(u.to_local(), coefficients).to(u.dtype)
            out[i] = DTensor.from_local(
                local,
                u.device_mesh,
                u.placements,
                run_check=False,
                shape=u.shape,
                stride=u.stride(),
            )
        elif u.device_mesh.ndim == 1 and u.placements == (Shard(0),):
            by_mesh.setdefault(id(u.device_mesh), []).append(i)
        else:
            full = orthogonalize(u.full_tensor(), coefficients)
            out[i] = _local_piece(full, u)
    for indices in by_mesh.values():
        owned = _owner_orthogonalize([updates[i] for i in indices], coefficients)
        for i, result in zip(indices, owned):
            out[i] = result
    return out  # type: ignore[return-value]


def _whole_experts(u: DTensor) -> bool:
    """An expert stack (E, in, out) split only along E: every local expert is complete."""
    return all(p.is_replicate() or (p.is_shard() and p.dim == 0) for p in u.placements)


def _local_piece(full: Tensor, like: DTensor) -> Tensor:
    """This rank's piece of `full` in `like`'s layout, as a DTensor."""
    replicated = DTensor.from_local(
        full, like.device_mesh, [Replicate()] * like.device_mesh.ndim, run_check=False
    )
    return replicated.redistribute(like.device_mesh, like.placements)


def _owner_orthogonalize(updates: list[DTensor], coefficients: Coefficients) -> list[Tensor]:
    """Rounds of P matrices: all P gathers (matrix j of the round to rank j) in flight at once,
    every rank orthogonalizes its one matrix, then all P scatters. Shards travel in bf16, the
    dtype Newton-Schulz computes in, so the result is bitwise the single-process one."""
    mesh = updates[0].device_mesh
    group, size = mesh.get_group(), mesh.size()
    me = dist.get_rank(group)
    ranks = dist.get_process_group_ranks(group)
    results: list[Tensor] = []
    for first in range(0, len(updates), size):
        batch = updates[first : first + size]
        padded = [_padded_shard(u, size) for u in batch]
        gathered = [
            [torch.empty_like(p) for _ in range(size)] if j == me else None
            for j, p in enumerate(padded)
        ]
        handles = [
            dist.gather(p, gathered[j], dst=ranks[j], group=group, async_op=True)
            for j, p in enumerate(padded)
        ]
        for handle in handles:
            handle.wait()
        send: list[list[Tensor] | None] = [None] * len(batch)
        if me < len(batch):
            rows = batch[me].shape[0]
            full = torch.cat(gathered[me])[:rows]  # type: ignore[arg-type]
            ortho = orthogonalize(full, coefficients)
            pad = padded[me].shape[0] * size - rows
            ortho = torch.cat([ortho, ortho.new_zeros((pad, *ortho.shape[1:]))])
            send[me] = list(ortho.chunk(size))
        received = [torch.empty_like(p) for p in padded]
        handles = [
            dist.scatter(received[j], send[j], src=ranks[j], group=group, async_op=True)
            for j in range(len(batch))
        ]
        for handle in handles:
            handle.wait()
        for u, piece in zip(batch, received):
            local = piece[: u.to_local().shape[0]].to(u.dtype)
            results.append(
                DTensor.from_local(
                    local, mesh, u.placements, run_check=False, shape=u.shape, stride=u.stride()
                )
            )
    return results


def _padded_shard(u: DTensor, size: int) -> Tensor:
    """This rank's dim-0 shard in bf16, zero-padded to FSDP2's full shard size ceil(rows / P)."""
    local = u.to_local()
    chunk = -(-u.shape[0] // size)
    padded = local.new_zeros((chunk, *local.shape[1:]), dtype=torch.bfloat16)
    padded[: local.shape[0]] = local
    return padded
