"""Token slots between token order, expert-sorted order and the weighted combine.

Shapes: N tokens, k slots per token (slot s = token s // k's (s % k)-th choice), M sorted rows
(N k, fewer when capacity dropping removed some), C d_model. `order` (M,) lists the kept slots
grouped by expert; `inverse` (N k,) is the sorted row of each slot, M for a dropped one.

The permutation is a stable sort of the slots' expert ids on the narrowest integer type that
holds them (`sort_slots`). Sorting the tokens is a gather forward and backward (no scatter-add:
faster on CPU and deterministic on GPU) of rows already cast to the experts' compute dtype; the
combine is a gather and a weighted sum: on CPU one fused embedding_bag, whose backward adds each
slot's weighted gradient into its row; elsewhere a gather whose backward, for the sorted rows
(each holds one slot), is a gather by the sorted order too (GatherSortedRows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def expert_counts(slot_expert: Tensor, n_experts: int) -> Tensor:
    """(N k,) expert ids -> (E,) int64 slots per expert. A scatter-add into E zeros rather than
    bincount, whose output length depends on the data: a compiled block traces it without a
    graph break (bincount split every compiled MoE block in two)."""
    ones = torch.ones_like(slot_expert)
    return slot_expert.new_zeros(n_experts).scatter_add_(0, slot_expert, ones)


def sort_slots(slot_expert: Tensor, n_experts: int) -> Tensor:
    """(N k,) expert ids -> (N k,) the slots grouped by expert, each expert's in slot order (a
    stable argsort). The ids are sorted as uint8 (int16 past 256 experts): a radix sort makes one
    pass per 8 key bits, and CUDA's (cub, all bits of the key type) would make 8 on int64; the
    permutation is the same (a stable sort has one answer). On a 2-core AVX2 CPU, 131072 ids:
    0.38 ms against 1.55 ms for int64 (CPU's int64 radix sort also runs threaded, and stalls
    when another process holds a core)."""
    key = torch.uint8 if n_experts <= 256 else torch.int16 if n_experts <= 2**15 else torch.int32
    return torch.argsort(slot_expert.to(key), stable=True)


def slot_rows(order: Tensor, n_slots: int) -> Tensor:
    """(N k,) the sorted row that holds each slot, or M (one past the rows) for a dropped slot."""
    M = order.numel()
    inverse = torch.full((n_slots,), M, dtype=order.dtype, device=order.device)
    inverse[order] = torch.arange(M, device=order.device)
    return inverse


def _rows_or_zero(t: Tensor, index: Tensor) -> Tensor:
    """t[index] where index == len(t) reads a zero row."""
    if index.numel() > t.shape[0]:  # more slots than rows: some slots were dropped
        t = torch.cat([t, t.new_zeros(1, t.shape[1])])
    return t.index_select(0, index)


def sum_over_slots(per_slot: Tensor, k: int, dtype: torch.dtype | None = None) -> Tensor:
    """(N k, C) rows in slot order -> (N, C): each token's k slot rows summed, in `dtype` (None:
    per_slot's). A bf16 input summed in fp32 equals its fp32 copy summed, bit for bit (each term
    converts exactly and the reduction runs in the same order), without that (N k, C) copy."""
    return per_slot.view(-1, k, per_slot.shape[1]).sum(dim=1, dtype=dtype)


class SortTokens(torch.autograd.Function):
    """flat (N, C) -> its rows in sorted slot order (M, C), in `dtype` (the experts' compute
    dtype): N rows are cast, then M gathered, instead of M gathered in flat's dtype (fp32 under
    autocast) and cast after. The same numbers; under bf16 autocast the gather moves half the
    bytes, eager skips an (M, C) fp32 copy and its cast, expert parallelism's all-to-all sends
    bf16. Backward: each slot's row gradient is gathered back to slot order and the token's k
    slots summed in flat's dtype (as autograd's cast, gather and fp32 sum did, bit for bit)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, flat: Tensor, order: Tensor, inverse: Tensor, k: int, dtype: torch.dtype
    ) -> Tensor:
        ctx.save_for_backward(inverse)
        ctx.k, ctx.flat_dtype = k, flat.dtype
        return flat.to(dtype).index_select(0, order // k)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        (inverse,) = ctx.saved_tensors
        per_slot = _rows_or_zero(grad.contiguous(), inverse)  # (N k, C) in grad's dtype
        return sum_over_slots(per_slot, ctx.k, ctx.flat_dtype), None, None, None, None


class GatherSortedRows(torch.autograd.Function):
    """rows (M, C) in sorted order -> rows[slot_row] (N k, C), where row r holds slot order[r]
    and every other slot reading it is a dropped one (weight 0, so a zero gradient). The backward
    is then a gather by `order`, not autograd's scatter-add: on CUDA that index_add is a bf16
    atomic kernel that inductor leaves to ATen, 1.1 ms per layer at N k = 131072, C = 1024 on an
    H200 (8% of the MoE step in bench/results/gpu_check_run3.json); the gather is a plain copy,
    deterministic, and equal to it (a row's sum has one nonzero term)."""

    @staticmethod
    def forward(ctx, rows: Tensor, slot_row: Tensor, order: Tensor) -> Tensor:  # type: ignore[override]
        assert rows.shape[0] == order.numel(), "one sorted row per kept slot"
        ctx.save_for_backward(order)
        return rows.index_select(0, slot_row)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        (order,) = ctx.saved_tensors
        return grad.contiguous().index_select(0, order), None, None


def combine_slots(
    rows: Tensor,
    slot_row: Tensor,
    weights: Tensor,
    kept: Tensor | None,
    order: Tensor | None = None,
) -> Tensor:
    """rows (R, C) expert outputs, slot_row (N, k) the row of each slot, weights (N, k) fp32,
    kept (N, k) bool or None (all kept), order (R,) or None: the slot each row holds when every
    row holds exactly one (the sorted rows; not padded ones) -> (N, C) in rows' dtype:

        out[t] = sum over kept j of weights[t, j] rows[slot_row[t, j]]

    One `embedding_bag` (a gather fused with the weighted sum; its backward hands each row its
    weighted gradient and each weight its dot product): on CPU 20-22 ms against 33-34 ms for a
    gather, a multiply and a sum, and 35-39 ms for a gather and a batched product (N = 4096,
    k = 8, C = 512, bf16, forward + backward; bench/moe_combine.py). A dropped slot's row may be
    any row: its weight and the weight's gradient are zeroed by `kept`.

    On other devices a gather, a product and a sum (`gather_combine`): CUDA's embedding_bag
    has no bf16 backward for the weights ("_embedding_bag_per_sample_weights_backward_cuda not
    implemented for 'BFloat16'", torch 2.11 on an H200)."""
    per_slot = weights.to(rows.dtype)
    if kept is not None:
        per_slot = per_slot * kept
    with torch.autocast(rows.device.type, enabled=False):  # the rows' dtype, not autocast's
        if embedding_bag_combines(rows.device.type):
            return F.embedding_bag(slot_row, rows, per_sample_weights=per_slot, mode="sum")
        return gather_combine(rows, slot_row, per_slot, order)


def embedding_bag_combines(device_type: str) -> bool:
    """Whether combine_slots uses embedding_bag on this device (its bf16 backward exists on CPU)."""
    return device_type == "cpu"


def gather_combine(
    rows: Tensor, slot_row: Tensor, per_slot: Tensor, order: Tensor | None = None
) -> Tensor:
    """combine_slots' sum as a gather, a product and a sum over the k slots (elementwise, so a
    compiled block fuses the product into the sum, and exact in fp32 where a bmm may use TF32):
    rows (R, C), slot_row (N, k), per_slot (N, k) in rows' dtype, order (R,) or None (see
    GatherSortedRows) -> (N, C)."""
    flat_rows = slot_row.reshape(-1)
    if order is None:
        gathered = rows.index_select(0, flat_rows)
    else:
        gathered = GatherSortedRows.apply(rows, flat_rows, order)
    gathered = gathered.view(*slot_row.shape, rows.shape[1])
    return (per_slot.unsqueeze(-1) * gathered).sum(dim=1)  # (N, k, C) -> (N, C)
