"""Initialize a sharded model to exactly the weights a single process would have.

Random initialization of DTensors is layout-dependent (and on CPU every shard would draw the
same numbers). Instead, each part of `Transformer.init_plan` (embedding, one block, ...) is
built full-size on the device, initialized from its own seed (`model.transformer.part_seed`),
and each rank keeps its shard. Peak extra memory: the largest part, one block.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Protocol

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from model.transformer import Transformer, part_seed, seeded


@torch.no_grad()
def init_like_single_process(model: Transformer, device: torch.device, seed: int) -> None:
    """`model` is materialized (`to_empty`) and sharded in any layout; fill it in place."""
    with torch.device("meta"):
        reference = Transformer(model.cfg)
    for index, (name, init) in enumerate(reference.init_plan()):
        if not holds_part(model, name):  # a pipeline stage's model holds some parts only
            continue
        replica = copy.deepcopy(reference.get_submodule(name)).to_empty(device=device)
        with seeded(device, part_seed(seed, index)):
            init(replica)
        _copy_shards(model.get_submodule(name), replica)
        del replica  # before the next part is built: at most one full part at a time


def holds_part(model: nn.Module, name: str) -> bool:
    """Whether `model` holds init part `name` (model/stages.py prunes a stage's model)."""
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


class Sliceable(Protocol):
    """A whole tensor read on demand (model/hf/expert_stack.py): `shape`, and `[slices]` gives
    the piece at one slice per dim (the first may be a tensor of indices), reading only that."""

    shape: torch.Size

    def __getitem__(self, index: tuple[slice | Tensor, ...]) -> Tensor: ...

    def detach(self) -> Sliceable: ...


Source = Tensor | Sliceable
# whole tensors in the model's names: one state dict, or its parts in turn
WeightParts = Mapping[str, Source] | Iterable[Mapping[str, Source]]


@torch.no_grad()
def load_weights(model: nn.Module, parts: WeightParts) -> None:
    """Fill `model` (sharded in any layout, or not) from its whole weights, given in parts (one
    state dict, or a stream of pieces of one: the names of its state_dict): each rank copies its
    shard of each tensor and drops the part before the next one is read, and cuts its rows
    before converting them, so a memory-mapped source is read only where this rank's shard
    lies. Every parameter and persistent buffer must come."""
    persistent = model.state_dict().keys()
    targets = dict(model.named_parameters()) | {
        name: b for name, b in model.named_buffers() if name in persistent
    }
    loaded: set[str] = set()
    for part in [parts] if isinstance(parts, Mapping) else parts:
        present = {name: t for name, t in targets.items() if name in part}
        _fill(present, part)
        loaded |= present.keys()
        del part  # before the next one is read
    missing = sorted(set(targets) - loaded)
    if missing:
        raise KeyError(
            f"the weights lack {', '.join(missing[:4])}" + (" ..." if len(missing) > 4 else "")
        )


def whole_weights(parts: WeightParts) -> dict[str, Tensor]:
    """The parts of some weights as one state dict of whole tensors."""
    merged: dict[str, Tensor] = {}
    for part in [parts] if isinstance(parts, Mapping) else parts:
        merged |= {name: t[tuple(slice(None) for _ in t.shape)] for name, t in part.items()}
    return merged


def _copy_shards(target: nn.Module, full: nn.Module) -> None:
    sources = dict(full.named_parameters()) | dict(full.named_buffers())
    _fill(dict(target.named_parameters()) | dict(target.named_buffers()), sources)


def _fill(targets: dict[str, Tensor], sources: Mapping[str, Source]) -> None:
    """Each target (a DTensor shard or a plain tensor) gets its piece of the whole source of
    the same name, converted to the target's dtype and device after the cut."""
    for name, tensor in targets.items():
        full = sources[name].detach()
        if full.shape != tensor.shape:
            raise ValueError(
                f"{name}: the weights hold {tuple(full.shape)}, the model {tuple(tensor.shape)}"
            )
        _local(tensor).copy_(_shard_of(full, tensor))


def _shard_of(full: Source, like: Tensor) -> Tensor:
    """This rank's piece of `full` in the layout of `like` (a DTensor or a plain tensor), cut
    locally from the whole tensor every rank holds (no communication): its slices where the
    layout is plain shards and replicas, else through `distribute_tensor`."""
    everything = tuple(slice(None) for _ in full.shape)
    if not isinstance(like, DTensor):
        return full[everything]
    if all(type(p) in (Shard, Replicate) for p in like.placements):
        shape, offset = compute_local_shape_and_global_offset(
            full.shape, like.device_mesh, like.placements
        )
        return full[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
    split = {p.dim for p in like.placements if isinstance(p, (Shard, _StridedShard))}
    if len(split) == 1:  # e.g. FSDP2 over expert parallelism: (_StridedShard(0), Shard(0))
        (dim,) = split
        index = list(everything)
        index[dim] = _local_indices(full.shape[dim], dim, like)
        return full[tuple(index)]
    full = full[everything].to(like.device_mesh.device_type)
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()


def _local_indices(size: int, dim: int, like: DTensor) -> slice | Tensor:
    """The indices along `dim` (the only one `like` splits) of this rank's piece: its layout
    applied to the indices themselves, a slice when they are consecutive."""
    placements = [_on_dim_0(p) for p in like.placements]
    ids = torch.arange(size, device=like.device_mesh.device_type)
    mine = distribute_tensor(ids, like.device_mesh, placements, src_data_rank=None).to_local()
    mine = mine.cpu()
    if len(mine) == 0:
        return slice(0, 0)
    if torch.equal(mine, torch.arange(int(mine[0]), int(mine[0]) + len(mine))):
        return slice(int(mine[0]), int(mine[0]) + len(mine))
    return mine


def _on_dim_0(placement):
    """The placement moved to dim 0 (the indices' only dim)."""
    if isinstance(placement, _StridedShard):
        return _StridedShard(0, split_factor=placement.split_factor)
    return Shard(0) if isinstance(placement, Shard) else placement


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
