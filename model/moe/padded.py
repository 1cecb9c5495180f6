"""Token slots straight into the experts' zero-padded layout and back: the local CPU route.

The general route (model/moe/layer.py) sorts the slots by expert and hands the sorted rows to the
experts, which on CPU copy them into an (E, capacity, C) zero-padded block for batched GEMMs and
select the real rows back out before the combine. When every expert is local, nothing is dropped
and the experts take the padded path, those copies have direct equivalents: one gather from
token order into the padded rows, and the combine reading the padded output rows itself. Forward
and backward alike, that is one gather in and one combine out instead of three copies and a zero
fill each way.

Shapes: N tokens, k slots per token (slot s = token s // k's (s % k)-th choice), M = N k slots,
E experts, P = E x capacity padded rows, C d_model.

    token_at_row (P,)  the token whose row fills each padded row; N (a zero row) on padding rows
    row_of_slot  (M,)  the padded row holding each slot

The numbers are those of the general route, bit for bit (tests/model/test_moe_padded.py): the
same rows, zero padding rows included, meet the same weights in the same GEMMs, and every sum
runs in the same order.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from model.moe.experts import GroupedExperts, padded_rows
from model.moe.slots import combine_slots, sum_over_slots


class PaddedLayout(NamedTuple):
    capacity: int  # rows per expert: the largest count
    token_at_row: Tensor  # (P,) N on padding rows
    row_of_slot: Tensor  # (M,)


def padded_layout(order: Tensor, counts: Tensor, k: int) -> PaddedLayout:
    """order (M,) the slots sorted by expert (stable), counts (E,) -> where each slot goes."""
    M, E = order.numel(), counts.numel()
    capacity = int(counts.max()) if M else 0
    rows = padded_rows(counts, M, capacity)  # (M,) padded row of each sorted slot
    row_of_slot = torch.empty_like(order).index_copy_(0, order, rows)
    N = M // k
    token_at_row = order.new_full((E * capacity,), N).index_copy_(0, rows, order // k)
    return PaddedLayout(capacity, token_at_row, row_of_slot)


class _TokensToPadded(torch.autograd.Function):
    """flat (N, C) -> (P, C) padded rows in `dtype`. Backward: each slot's gradient row is
    gathered and a token's k slots summed in flat's dtype (padding rows' gradients are dropped:
    they are zero)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, flat: Tensor, token_at_row: Tensor, row_of_slot: Tensor, k: int, dtype: torch.dtype
    ) -> Tensor:
        ctx.save_for_backward(row_of_slot)
        ctx.k, ctx.flat_dtype = k, flat.dtype
        x = flat.to(dtype)  # cast N rows, not P
        with_zero_row = torch.cat([x, x.new_zeros(1, x.shape[1])])  # row N: padding
        return with_zero_row.index_select(0, token_at_row)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        (row_of_slot,) = ctx.saved_tensors
        per_slot = grad.contiguous().index_select(0, row_of_slot)  # (M, C) in grad's dtype
        return sum_over_slots(per_slot, ctx.k, ctx.flat_dtype), None, None, None, None


def padded_route(
    flat: Tensor, order: Tensor, counts: Tensor, weights: Tensor, experts: GroupedExperts
) -> Tensor:
    """flat (N, C), order (M,) slots by expert, counts (E,), weights (N, k) -> (N, C): each
    token's k expert outputs, weighted and summed, in the experts' compute dtype."""
    k, C = weights.shape[1], flat.shape[1]
    layout = padded_layout(order, counts, k)
    dtype = experts.compute_dtype(flat)
    padded = _TokensToPadded.apply(flat, layout.token_at_row, layout.row_of_slot, k, dtype)
    E = counts.numel()
    y = experts(padded.view(E, layout.capacity, C), None).view(-1, C)  # (P, C), padded_forward
    return combine_slots(y, layout.row_of_slot.view(-1, k), weights, None)  # (N, C)
