"""The MoE combine's two forms (model/moe/slots.py): CPU's embedding_bag and the gather, product
and sum used on CUDA (whose embedding_bag has no bf16 weight backward), both through
combine_slots, against an obvious fp64 loop."""

import pytest
import torch

from model.moe import slots
from model.moe.slots import combine_slots


def loop_combine(rows, slot_row, weights, kept):
    out = torch.zeros(slot_row.shape[0], rows.shape[1], dtype=torch.float64)
    for t in range(slot_row.shape[0]):
        for j in range(slot_row.shape[1]):
            if kept is None or kept[t, j]:
                out[t] += weights[t, j].double() * rows[slot_row[t, j]].double()
    return out


def inputs(dtype):
    """As the MoE layer calls it: each kept slot its own row, every dropped slot row 0."""
    gen = torch.Generator().manual_seed(0)
    N, k, C = 12, 3, 16
    kept = torch.rand(N, k, generator=gen) > 0.2
    slot_row = torch.where(kept, torch.randperm(N * k, generator=gen).view(N, k), 0)
    rows = torch.randn(N * k, C, generator=gen).to(dtype).requires_grad_()
    weights = torch.rand(N, k, generator=gen).requires_grad_()
    return rows, slot_row, weights, kept


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("embedding_bag", [True, False])
def test_combine_matches_loop_forward_and_backward(monkeypatch, embedding_bag, dtype, tol):
    monkeypatch.setattr(slots, "embedding_bag_combines", lambda device_type: embedding_bag)
    rows, slot_row, weights, kept = inputs(dtype)
    assert (slot_row == 0).sum() > 1  # dropped slots share row 0 with a kept one
    out = combine_slots(rows, slot_row, weights, kept)
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


def test_the_two_forms_agree_in_fp32():
    rows, slot_row, weights, kept = inputs(torch.float32)
    per_slot = weights * kept
    fused = torch.nn.functional.embedding_bag(
        slot_row, rows, per_sample_weights=per_slot, mode="sum"
    )
    torch.testing.assert_close(slots.gather_combine(rows, slot_row, per_slot), fused)


def sorted_inputs(dtype):
    """As the MoE layer's general route calls it: M kept slots, row r of the expert outputs holds
    slot order[r]; a dropped slot reads row 0 with weight 0."""
    gen = torch.Generator().manual_seed(2)
    N, k, C = 12, 3, 16
    kept = torch.rand(N, k, generator=gen) > 0.2
    order = torch.nonzero(kept.flatten()).flatten()
    order = order[torch.randperm(order.numel(), generator=gen)]  # any grouping by expert
    slot_row = slots.slot_rows(order, N * k).view(N, k)
    slot_row = torch.where(kept, slot_row, 0)
    rows = torch.randn(order.numel(), C, generator=gen).to(dtype).requires_grad_()
    return rows, slot_row, (torch.rand(N, k, generator=gen) * kept).to(dtype), order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sorted_rows_gather_back_as_autograd_scatters_them(dtype):
    """GatherSortedRows' backward (a gather by order) equals autograd's index_add, bit for bit:
    each row's sum has one nonzero term (its kept slot) and dropped slots add exact zeros."""
    rows, slot_row, per_slot, order = sorted_inputs(dtype)
    assert (slot_row == 0).sum() > 1
    cot = torch.randn(slot_row.shape[0], rows.shape[1], generator=torch.Generator().manual_seed(3))
    grads = []
    for with_order in (order, None):
        out = slots.gather_combine(rows, slot_row, per_slot, with_order)
        grads.append((out, *torch.autograd.grad(out, rows, cot.to(dtype))))
    for got, want in zip(*grads, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("capacity_factor", [0.0, 1.0])  # nothing dropped; some dropped
def test_the_moe_layer_combines_through_the_sorted_gather_off_cpu(monkeypatch, capacity_factor):
    """The layer's general route hands `order` to the combine: with the gather forced (as on
    CUDA) its output and gradients equal the embedding_bag form's (CPU's)."""
    from model.init import block_init_stds
    from model.moe.layer import MoE
    from model.presets import load_preset

    cfg = load_preset("tiny_moe", {"moe.capacity_factor": capacity_factor})
    results = []
    for embedding_bag in (True, False):
        monkeypatch.setattr(slots, "embedding_bag_combines", lambda d, e=embedding_bag: e)
        torch.manual_seed(0)
        layer = MoE(cfg, 1)
        layer.init_weights(block_init_stds(cfg.init, cfg.n_layers, 1))
        layer.experts.impl = "loop"  # the general (sorted) route, not CPU's padded one
        x = torch.randn(2, 24, cfg.d_model, generator=torch.Generator().manual_seed(4))
        x.requires_grad_()
        out = layer(x)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(5)))
        results.append((out, x.grad, layer.experts.w_down.grad, layer.router.gate.weight.grad))
    assert capacity_factor == 0 or layer.dropped_tokens.item() > 0
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n_experts", [8, 256, 300])  # uint8 ids, the largest uint8, int16
def test_sorting_narrow_ids_gives_the_int64_stable_permutation(n_experts):
    ids = torch.randint(0, n_experts, (4096,), generator=torch.Generator().manual_seed(6))
    assert torch.equal(slots.sort_slots(ids, n_experts), torch.argsort(ids, stable=True))


@pytest.mark.parametrize("dropped", [False, True])
def test_sorting_tokens_in_the_compute_dtype_equals_gathering_then_casting(dropped):
    """SortTokens casting the N token rows and gathering M equals gathering M fp32 rows and
    casting them (the layer before): the same rows, and the same gradient, bit for bit (each
    token's k slot gradients summed in fp32 in slot order either way; dropped slots add zeros).
    The gradients span 2^-30..2^30, so that fp32 sums of bf16 values round."""
    gen = torch.Generator().manual_seed(7)
    N, k, C = 40, 4, 24
    order = torch.argsort(torch.randint(0, 8, (N * k,), generator=gen), stable=True)
    if dropped:
        order = order[torch.rand(N * k, generator=gen) > 0.3]
    inverse = slots.slot_rows(order, N * k)
    flat = torch.randn(N, C, generator=gen, requires_grad=True)
    scale = 2.0 ** torch.randint(-30, 30, (order.numel(), C), generator=gen)
    cot = (torch.randn(order.numel(), C, generator=gen) * scale).bfloat16()
    results = []
    for dtype in (torch.bfloat16, torch.float32):
        rows = slots.SortTokens.apply(flat, order, inverse, k, dtype).to(torch.bfloat16)
        results.append((rows, *torch.autograd.grad(rows, flat, cot)))
    (got, got_grad), (want, want_grad) = results
    assert got_grad.dtype == torch.float32
    assert torch.equal(got, want) and torch.equal(got_grad, want_grad)
    assert torch.equal(want, flat.index_select(0, order // k).to(torch.bfloat16))
