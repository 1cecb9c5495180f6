"""Each request's continuation log-likelihood (the sum of its tokens' log-probabilities),
computed in length-packed batches shared out over ranks and summed over them."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from parallel.collective import several_ranks
from trainer.downstream.batches import batch_tensors, idle_batch, pack
from trainer.downstream.tasks import Request

# (inputs, targets, doc_ids) -> (B, T) fp32 target log-probabilities, 0 where ignored
# (TrainingEngine.evaluation_log_probs, or a bare model's per_token forward)
LogProbs = Callable[[Tensor, Tensor, Tensor | None], Tensor]


@torch.no_grad()
def log_likelihoods(
    log_probs_of: LogProbs,
    requests: Sequence[Request],
    batch_tokens: int,
    pad_id: int,
    device: torch.device,
    stop: Callable[[], bool] = lambda: False,
    progress: Callable[[int], None] | None = None,
) -> Tensor | None:
    """(len(requests),) float64 on the CPU, the same on every rank; None when `stop` (which
    every rank must agree on) interrupted it. Every rank must call it (collective forwards).
    `progress(n)`: n more requests were scored on this rank."""
    batches = pack(requests, batch_tokens)
    rank, world = (dist.get_rank(), dist.get_world_size()) if several_ranks() else (0, 1)
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
            index = torch.tensor(mine[turn], device=device)
            sums[index] = scores.double().sum(dim=-1)
            if progress is not None:
                progress(len(mine[turn]))
    if several_ranks():
        dist.all_reduce(sums)  # each request was scored on exactly one rank; 0 elsewhere
    return sums.cpu()
