"""Initialize a sharded model to exactly the weights a single process would have.

Random initialization of DTensors is layout-dependent (and on CPU every shard would draw the
same numbers). Instead, each part of `Transformer.init_plan` (embedding, one block, ...) is
built full-size on the device, initialized from its own seed (`model.transformer.part_seed`),
and each rank keeps its shard. Peak extra memory: the largest part, one block.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from model.transformer import Transformer, part_seed, seeded


@torch.no_grad()
def init_like_single_process(model: Transformer, device: torch.device, seed: int) -> None:
    """`model` is materialized (`to_empty`) and sharded in any layout; fill it in place."""
    with torch.device("meta"):
        reference = Transformer(model.cfg)
    for index, (name, init) in enumerate(reference.init_plan()):
        replica = copy.deepcopy(reference.get_submodule(name)).to_empty(device=device)
        with seeded(device, part_seed(seed, index)):
            init(replica)
        _copy_shards(model.get_submodule(name), replica)
        del replica  # before the next part is built: at most one full part at a time


@torch.no_grad()
def load_whole_weights(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Fill `model` (sharded in any layout, or not) from the whole `state` (its state_dict's
    names): each rank keeps its shard. Every parameter and persistent buffer must be there."""
    persistent = model.state_dict().keys()
    targets = dict(model.named_parameters()) | {
        name: b for name, b in model.named_buffers() if name in persistent
    }
    missing = sorted(set(targets) - set(state))
    if missing:
        raise KeyError(
            f"the weights lack {', '.join(missing[:4])}" + (" ..." if len(missing) > 4 else "")
        )
    _fill(targets, state)


def _copy_shards(target: nn.Module, full: nn.Module) -> None:
    sources = dict(full.named_parameters()) | dict(full.named_buffers())
    _fill(dict(target.named_parameters()) | dict(target.named_buffers()), sources)


def _fill(targets: dict[str, Tensor], sources: dict[str, Tensor]) -> None:
    """Each target (a DTensor shard or a plain tensor) gets its piece of the whole source of
    the same name, in the target's dtype."""
    for name, tensor in targets.items():
        full = sources[name].to(device=_local(tensor).device, dtype=tensor.dtype)
        if full.shape != tensor.shape:
            raise ValueError(
                f"{name}: the weights hold {tuple(full.shape)}, the model {tuple(tensor.shape)}"
            )
        _local(tensor).copy_(_shard_of(full, tensor))


def _shard_of(full: Tensor, like: Tensor) -> Tensor:
    """This rank's piece of `full` in the layout of `like` (a DTensor or a plain tensor): cut
    locally from the full tensor every rank holds (src_data_rank=None: no communication)."""
    if not isinstance(like, DTensor):
        return full
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
