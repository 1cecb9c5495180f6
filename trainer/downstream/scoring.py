"""Each request's continuation log-likelihood (the sum of its tokens' log-probabilities),
computed in length-packed batches shared out over ranks and summed over them."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from parallel.collective import several_ranks
from trainer.downstream.batches import PackedBatch, batch_tensors, idle_batch
from trainer.downstream.tasks import Request

# (inputs, targets, doc_ids) -> (B, T) fp32 target log-probabilities, 0 where ignored
# (TrainingEngine.evaluation_log_probs, or a bare model's per_token forward)
LogProbs = Callable[[Tensor, Tensor, Tensor | None], Tensor]


@torch.no_grad()
def log_likelihoods(
    log_probs_of: LogProbs,
    requests: Sequence[Request],
    batches: Sequence[PackedBatch],
    pad_id: int,
    device: torch.device,
    stop: Callable[[], bool] = lambda: False,
    progress: Callable[[int], None] | None = None,
    together: int | tuple[int, int, bool] = 1,
) -> Tensor | None:
    """(len(requests),) float64 on the CPU, the same on every rank; None when `stop` (which
    every rank must agree on) interrupted it. Every rank must call it (collective forwards).
    `batches`: trainer.downstream.batches.pack's; `progress(n)`: n more requests were scored
    on this rank; `together`: consecutive ranks that run one forward on the same batch (tensor
    parallelism, TrainingEngine.ranks_per_forward; context-parallel ranks score forwards whole,
    each its own batches), or (this rank's group, the groups, whether it reports the group's
    scores) as TrainingEngine.scoring_share gives it (a pipeline's ranks are not consecutive)."""
    rank, world, leader = _share(together)
    mine = batches[rank::world]
    sums = torch.zeros(len(requests), dtype=torch.float64, device=device)
    for turn in range(math.ceil(len(batches) / world)):
        if stop():
            return None
        if turn < len(mine):
            inputs, targets = batch_tensors(requests, mine[turn], pad_id)
        else:
            inputs, targets = idle_batch(pad_id)
        scores = log_probs_of(inputs.to(device), targets.to(device), None)
        if turn < len(mine):
            rows = mine[turn].indices
            sums[torch.tensor(rows, device=device)] = scores[: len(rows)].double().sum(dim=-1)
            if progress is not None:
                progress(len(rows))
    if several_ranks():
        if not leader:  # each request was scored by one group: its leader reports it
            sums.zero_()
        dist.all_reduce(sums)
    return sums.cpu()


def _share(together: int | tuple[int, int, bool]) -> tuple[int, int, bool]:
    """(this rank's scoring group, how many groups, whether it reports its group's scores)."""
    if isinstance(together, tuple):
        return together
    rank, world = (dist.get_rank(), dist.get_world_size()) if several_ranks() else (0, 1)
    return rank // together, world // together, rank % together == 0
