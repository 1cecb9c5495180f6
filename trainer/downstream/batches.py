"""Requests packed by length into batches of at most `batch_tokens` (rows x padded length), and
shared out over ranks.

Sorting by length keeps padding small; the packing depends only on the requests and the settings,
so one rank and many ranks forward the same batches (only which rank runs each differs) and score
every request identically. Under FSDP, expert parallelism or ZeRO-3 every forward is collective:
a rank with fewer batches than the others runs a one-token forward per missing batch.

Compiled forwards (FlexAttention, a compiled run's evaluation) compile once per input shape: with
`width_multiple` > 1 each width is rounded up to a multiple of it and every batch of one width gets
the same number of rows (empty rows fill the last), so there are at most longest / width_multiple
shapes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from model.loss import IGNORE_INDEX
from trainer.downstream.tasks import Request


@dataclass(frozen=True)
class PackedBatch:
    indices: list[int]  # the requests it scores, longest first
    width: int  # padded length
    rows: int  # padded row count (>= len(indices))

    @property
    def tokens(self) -> int:
        return self.rows * self.width


def pack(
    requests: Sequence[Request], batch_tokens: int, width_multiple: int = 1
) -> list[PackedBatch]:
    """The batches, longest first; a request longer than the budget goes alone."""
    if not requests:
        return []
    order = sorted(range(len(requests)), key=lambda i: (-len(requests[i].tokens), i))
    longest = len(requests[order[0]].tokens)

    def width_of(index: int) -> int:  # rounded up, never past the longest request
        return min(
            math.ceil(len(requests[index].tokens) / width_multiple) * width_multiple, longest
        )

    batches: list[PackedBatch] = []
    current: list[int] = []
    for index in order:
        width = width_of(current[0]) if current else 0  # the longest comes first
        if current and ((len(current) + 1) * width > batch_tokens or width_of(index) != width):
            batches.append(_batch(current, width, batch_tokens, width_multiple))
            current = []
        current.append(index)
    batches.append(_batch(current, width_of(current[0]), batch_tokens, width_multiple))
    return batches


def _batch(indices: list[int], width: int, batch_tokens: int, width_multiple: int) -> PackedBatch:
    """Tight rows, or (fixed shapes) as many rows as the budget gives this width."""
    rows = max(len(indices), batch_tokens // width) if width_multiple > 1 else len(indices)
    return PackedBatch(indices, width, rows)


def batch_tensors(
    requests: Sequence[Request], batch: PackedBatch, pad_id: int
) -> tuple[Tensor, Tensor]:
    """(inputs, targets), both (rows, width): inputs right-padded with `pad_id` (causal: the
    padding never reaches a scored position); targets IGNORE_INDEX except the continuations."""
    inputs = torch.full((batch.rows, batch.width), pad_id, dtype=torch.long)
    targets = torch.full((batch.rows, batch.width), IGNORE_INDEX, dtype=torch.long)
    for row, index in enumerate(batch.indices):
        request = requests[index]
        inputs[row, : len(request.tokens)] = torch.tensor(request.tokens)
        end = request.start + len(request.continuation)
        targets[row, request.start : end] = torch.tensor(request.continuation)
    return inputs, targets


def idle_batch(pad_id: int) -> tuple[Tensor, Tensor]:
    """A one-token forward with nothing scored (a rank's part in a collective forward)."""
    return torch.full((1, 1), pad_id, dtype=torch.long), torch.full((1, 1), IGNORE_INDEX)
