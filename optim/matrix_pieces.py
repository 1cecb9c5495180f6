"""Where each rank's piece of a DTensor's matrices lies in the whole matrix.

A piece is what a rank holds under DTensor placements: Shard (torch.chunk) and _StridedShard
(FSDP2's rows of tensor parallelism's rows) on either matrix dim, in mesh order, as DTensor
splits, so that pieces assembled by their plan give what full_tensor() gives. Used by
optim.distributed_muon to gather each matrix whole onto its owner and scatter the result.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard


def shard_dim(placement) -> int | None:
    """The tensor dim a placement splits (Shard or FSDP2's _StridedShard), else None."""
    if placement.is_shard() or isinstance(placement, _StridedShard):
        return placement.dim
    return None


Index = slice | Tensor  # the rows (or columns) of the whole matrix a piece holds


@dataclass(frozen=True)
class Plan:
    """Where each gather-group rank's piece of a (rows, cols) matrix lies in it."""

    shape: tuple[int, int]
    pieces: tuple[tuple[Index, Index], ...]  # by rank in the gather group: (rows, cols)
    size: int  # elements of the largest piece: every piece travels padded to it

    def take(self, whole: Tensor, member: int) -> Tensor:
        rows, cols = self.pieces[member]
        if isinstance(rows, slice) and isinstance(cols, slice):
            return whole[rows, cols]
        return whole[_indices(rows, self.shape[0])[:, None], _indices(cols, self.shape[1])]

    def put(self, whole: Tensor, member: int, flat: Tensor) -> None:
        rows, cols = self.pieces[member]
        piece = flat[: _length(rows) * _length(cols)].view(_length(rows), _length(cols))
        if isinstance(rows, slice) and isinstance(cols, slice):
            whole[rows, cols] = piece
        else:
            whole[_indices(rows, self.shape[0])[:, None], _indices(cols, self.shape[1])] = piece


def _indices(index: Index, size: int) -> Tensor:
    return torch.arange(size)[index] if isinstance(index, slice) else index


@functools.lru_cache(maxsize=1024)
def plan_pieces(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple, coordinates: tuple
) -> Plan:
    """The pieces of each matrix of a `shape` DTensor (the last two dims) held by the ranks at
    `coordinates` (their mesh coordinates, in gather-group order), by DTensor's split rules
    (Shard: torch.chunk; _StridedShard: FSDP2's split of tp's shards), so that assembling them
    gives what full_tensor() gives."""
    first = len(shape) - 2
    pieces = []
    for coordinate in coordinates:
        index = []
        for tensor_dim in (first, first + 1):
            held = torch.arange(shape[tensor_dim])
            for mesh_dim, placement in enumerate(placements):
                if shard_dim(placement) == tensor_dim:  # in mesh order, as DTensor splits
                    split = placement if placement.dim == 0 else _on_dim0(placement)
                    chunks, _ = split._split_tensor(held, mesh_shape[mesh_dim], with_padding=False)
                    held = chunks[coordinate[mesh_dim]]
            index.append(_as_slice(held))
        pieces.append(tuple(index))
    size = max(_length(r) * _length(c) for r, c in pieces)
    return Plan((shape[first], shape[first + 1]), tuple(pieces), size)


def _on_dim0(placement):
    """The same split applied to a 1-D index vector."""
    if isinstance(placement, _StridedShard):
        return _StridedShard(0, split_factor=placement.split_factor)
    return Shard(0)


def _as_slice(held: Tensor) -> Index:
    """A contiguous run of indices as a slice (copied without indexing), else the indices."""
    if held.numel() == 0:
        return slice(0, 0)
    start = int(held[0])
    if torch.equal(held, torch.arange(start, start + held.numel())):
        return slice(start, start + held.numel())
    return held


def _length(index: Index) -> int:
    return index.stop - index.start if isinstance(index, slice) else index.numel()
