"""Global gradient-norm clipping over sharded (DTensor) gradients, in one collective.

`torch.nn.utils.clip_grad_norm_` cannot mix DTensors of different meshes (dense weights on the
data-parallel mesh, experts on the expert meshes). Here each rank sums the squares of its local
gradient pieces, divided by how many ranks hold an identical copy (the mesh dims on which the
gradient is replicated, such as HSDP's replicas), and one all-reduce over the world gives the
exact global sum of squares. Sparse gradients (Engram's tables in one process) count their
coalesced rows.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

from parallel.collective import rank_and_size, several_ranks


def _copies(grad: Tensor, tp: int = 1) -> int:
    """Ranks holding the same values as this rank's `grad`: a plain tensor's are everywhere; a
    DTensor's, its replicated mesh dims, times tp when its mesh has no "tp" dim (a weight that
    tensor parallelism left whole, which every rank of a tp group holds)."""
    if not isinstance(grad, DTensor):
        return rank_and_size()[1]
    mesh = grad.device_mesh
    copies = math.prod(
        mesh.size(i) for i, p in enumerate(grad.placements) if isinstance(p, Replicate)
    )
    return copies * (tp if "tp" not in (mesh.mesh_dim_names or ()) else 1)


def global_grad_norm(params: list[torch.nn.Parameter], tp: int = 1) -> Tensor:
    """The L2 norm of all gradients as if they were whole on one device (fp32 scalar); `tp`:
    the tensor-parallel degree (parallel/tensor_parallel.py)."""
    by_copies: dict[int, list[Tensor]] = {}  # gradients grouped by how many ranks hold them
    for p in params:
        if p.grad is not None:
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            if local.is_sparse:  # repeated rows summed before squaring
                local = p.grad = local.coalesce()
                local = local.values()
            by_copies.setdefault(_copies(p.grad, tp), []).append(local)
    if not by_copies:
        return torch.zeros(())
    device = next(iter(by_copies.values()))[0].device
    total = sum(  # (norms moved to one device: offloaded Engram tables keep theirs in host memory)
        torch.stack([n.to(device) for n in torch._foreach_norm(grads, 2)]).float().square().sum()
        / copies
        for copies, grads in by_copies.items()
    )
    if several_ranks():
        dist.all_reduce(total)
    return total.sqrt()


@torch.no_grad()
def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float, tp: int = 1) -> Tensor:
    """Scale gradients so their global norm is at most `max_norm` (inf: only measure)."""
    norm = global_grad_norm(params, tp)
    if max_norm != float("inf"):
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        if scale.item() == 1.0:  # within the limit (most steps of a long run): x * 1 == x, so
            return norm  # no pass over every gradient (the caller reads the norm next anyway)
        locals_ = [
            p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            for p in params
            if p.grad is not None
        ]
        dense = [g for g in locals_ if not g.is_sparse]
        torch._foreach_mul_(dense, scale)
        for g in locals_:
            if g.is_sparse:
                g._values().mul_(scale.to(g.device))  # (coalesced or not)
    return norm


def tp_size(model: torch.nn.Module) -> int:
    """The tensor-parallel degree `model` was split with (1 when it was not): the size of the
    "tp" dim of the first parameter whose mesh has one."""
    for p in model.parameters():
        names = p.device_mesh.mesh_dim_names or () if isinstance(p, DTensor) else ()
        if "tp" in names:
            return p.device_mesh.size(names.index("tp"))
    return 1
