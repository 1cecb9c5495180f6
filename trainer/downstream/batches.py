"""Requests packed by length into batches of at most `batch_tokens` (rows x padded length), and
shared out over ranks.

Sorting by length keeps padding small; the packing depends only on the requests and the budget,
so one rank and many ranks forward the same batches (only which rank runs each differs) and score
every request identically. Under FSDP, expert parallelism or ZeRO-3 every forward is collective:
a rank with fewer batches than the others runs a one-token forward per missing batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from model.loss import IGNORE_INDEX
from trainer.downstream.tasks import Request


def pack(requests: Sequence[Request], batch_tokens: int) -> list[list[int]]:
    """Request indices per batch, longest first; a request longer than the budget goes alone."""
    order = sorted(range(len(requests)), key=lambda i: (-len(requests[i].tokens), i))
    batches: list[list[int]] = []
    current: list[int] = []
    for index in order:
        width = len(requests[current[0]].tokens) if current else 0  # the longest comes first
        if current and (len(current) + 1) * width > batch_tokens:
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


def batch_tensors(
    requests: Sequence[Request], indices: Sequence[int], pad_id: int
) -> tuple[Tensor, Tensor]:
    """(inputs, targets), both (rows, longest): inputs right-padded with `pad_id` (causal: the
    padding never reaches a scored position); targets IGNORE_INDEX except the continuations."""
    width = max(len(requests[i].tokens) for i in indices)
    inputs = torch.full((len(indices), width), pad_id, dtype=torch.long)
    targets = torch.full((len(indices), width), IGNORE_INDEX, dtype=torch.long)
    for row, index in enumerate(indices):
        request = requests[index]
        inputs[row, : len(request.tokens)] = torch.tensor(request.tokens)
        end = request.start + len(request.continuation)
        targets[row, request.start : end] = torch.tensor(request.continuation)
    return inputs, targets


def idle_batch(pad_id: int) -> tuple[Tensor, Tensor]:
    """A one-token forward with nothing scored (a rank's part in a collective forward)."""
    return torch.full((1, 1), pad_id, dtype=torch.long), torch.full((1, 1), IGNORE_INDEX)
