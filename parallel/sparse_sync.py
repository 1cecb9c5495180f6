"""Averaging sparse row gradients over the data-parallel ranks (Engram tables that every rank
holds whole: model.engram.sharding=replicated).

Each rank has a sparse (N, D) gradient of the rows its tokens read. One all-gather of the row
counts, one of the padded row ids and one of the padded rows give every rank all of them; summed
(coalesced) and divided by the number of ranks, the gradient is the mean that FSDP2 gives dense
weights, identical on every rank, so the row-wise Adam steps stay identical too. The traffic is
O(rows read x ranks), not O(table).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def _gather_padded(local: Tensor, count: int, longest: int, world: int) -> list[Tensor]:
    padded = local.new_zeros((longest, *local.shape[1:]))
    padded[:count] = local
    out = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)
    return out


@torch.no_grad()
def average_sparse_gradients(params: list[torch.nn.Parameter]) -> None:
    """Replace each parameter's sparse gradient by its mean over all ranks (in place of .grad);
    a rank without a gradient for one contributes no rows (every rank must call this with the
    same parameters in the same order)."""
    world = dist.get_world_size()
    for param in params:
        grad = param.grad
        if grad is None:
            grad = torch.sparse_coo_tensor(
                torch.zeros(1, 0, dtype=torch.long, device=param.device),
                param.new_zeros(0, *param.shape[1:]),
                param.shape,
                check_invariants=False,
            )
        grad = grad.coalesce()
        rows, values = grad.indices()[0], grad.values()
        counts = torch.tensor([rows.numel()], device=param.device)
        all_counts = [torch.empty_like(counts) for _ in range(world)]
        dist.all_gather(all_counts, counts)
        sizes = [int(c) for c in all_counts]
        longest = max(max(sizes), 1)
        gathered_rows = _gather_padded(rows, rows.numel(), longest, world)
        gathered_values = _gather_padded(values, rows.numel(), longest, world)
        index = torch.cat([r[:n] for r, n in zip(gathered_rows, sizes, strict=True)])
        summed = torch.cat([v[:n] for v, n in zip(gathered_values, sizes, strict=True)])
        grad = torch.sparse_coo_tensor(
            index[None], summed / world, param.shape, check_invariants=False
        )
        param.grad = grad.coalesce()  # (built from valid rows: no invariant check needed)
