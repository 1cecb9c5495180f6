"""Small agreements between the ranks of a launch (all no-ops in one process), and the one
"are there several ranks?" test that the rest of the code asks.

The trainer's decisions that every rank must take alike (stop, skip, which checkpoint, whether a
background write has finished) go through these, on the default process group. Flags travel as
int32 tensors: on the GPU under NCCL alone, on the CPU when the group has a gloo side.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def several_ranks() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier() -> None:
    if several_ranks():
        dist.barrier()


def _flag(value: int) -> torch.Tensor:
    flag = torch.tensor([value], dtype=torch.int32)
    return flag if "gloo" in str(dist.get_backend()) else flag.cuda()


def all_true(ok: bool) -> bool:
    """True when `ok` holds on every rank."""
    if not several_ranks():
        return ok
    flag = _flag(int(ok))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def max_over_ranks(value: int) -> int:
    if not several_ranks():
        return value
    flag = _flag(value)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def worst_over_ranks(verdict: int, reason: str) -> tuple[int, str]:
    """The highest `verdict` of any rank, with the `reason` of the first rank that has it (so
    rank 0 can say what another rank found)."""
    if not several_ranks():
        return verdict, reason
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (verdict, reason))
    return max(every, key=lambda item: item[0])


def from_main(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (any picklable value)."""
    if not several_ranks():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def to_main(obj: Any) -> list[Any] | None:
    """Every rank's `obj`, in rank order, on rank 0 (None on the others)."""
    if not several_ranks():
        return [obj]
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def rank_and_size() -> tuple[int, int]:
    if not several_ranks():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()
