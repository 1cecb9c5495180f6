"""The MoE combine's two forms (model/moe/slots.py): CPU's embedding_bag and the gather + batched
product used on CUDA (whose embedding_bag has no bf16 weight backward) against an obvious loop."""

import pytest
import torch

from model.moe.slots import combine_slots, gather_combine


def loop_combine(rows, slot_row, weights, kept):
    out = torch.zeros(slot_row.shape[0], rows.shape[1], dtype=torch.float64)
    for t in range(slot_row.shape[0]):
        for j in range(slot_row.shape[1]):
            if kept is None or kept[t, j]:
                out[t] += weights[t, j].double() * rows[slot_row[t, j]].double()
    return out


def inputs(dtype):
    gen = torch.Generator().manual_seed(0)
    N, k, R, C = 12, 3, 40, 16
    rows = torch.randn(R, C, generator=gen).to(dtype).requires_grad_()
    slot_row = torch.randperm(R, generator=gen)[: N * k].view(N, k)
    weights = torch.rand(N, k, generator=gen).requires_grad_()
    kept = torch.rand(N, k, generator=gen) > 0.2  # some dropped slots
    return rows, slot_row, weights, kept


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("form", ["embedding_bag", "gather_bmm"])
def test_combine_matches_loop_forward_and_backward(form, dtype, tol):
    rows, slot_row, weights, kept = inputs(dtype)
    if form == "embedding_bag":
        out = combine_slots(rows, slot_row, weights, kept)
    else:  # what combine_slots runs on CUDA
        out = gather_combine(rows, slot_row, weights.to(dtype) * kept)
    ref_rows = rows.detach().double().requires_grad_()
    ref_weights = weights.detach().double().requires_grad_()
    ref = loop_combine(ref_rows, slot_row, ref_weights, kept)
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    cot = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    (out.double() * cot).sum().backward()
    (ref * cot.double()).sum().backward()
    torch.testing.assert_close(rows.grad.double(), ref_rows.grad, atol=tol, rtol=tol)
    torch.testing.assert_close(weights.grad.double(), ref_weights.grad, atol=tol * 4, rtol=tol)
    assert (weights.grad[~kept] == 0).all()  # a dropped slot's weight gets no gradient
