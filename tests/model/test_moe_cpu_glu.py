"""The fused threaded GLU experts (model/moe/cpu_glu.py) against a float64 per-expert loop,
forward and every gradient, for SiLU and GELU, empty groups and several thread counts; the
activation memory it keeps; activations without a fused backward refused, and GroupedExperts
taking the unfused threaded GEMMs for them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from model.init import InitStds
from model.moe import GroupedExperts
from model.moe.cpu_glu import threaded_glu_experts

COUNTS = [6, 0, 3, 0, 9, 1, 0, 5, 0]  # empty groups at a range's start, inside, and last
C, F_ = 16, 24


def weights(dtype=torch.float32, seed=0) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(seed)
    G = len(COUNTS)
    return tuple(
        (0.3 * torch.randn(shape, dtype=dtype)).requires_grad_()
        for shape in ((G, C, F_), (G, C, F_), (G, F_, C))
    )


def reference(x: torch.Tensor, ws: tuple[torch.Tensor, ...], act) -> torch.Tensor:
    rows = torch.split(x, COUNTS)
    return torch.cat([(act(r @ ws[0][g]) * (r @ ws[1][g])) @ ws[2][g] for g, r in enumerate(rows)])


@pytest.mark.parametrize("n_threads", [1, 2, 3])
@pytest.mark.parametrize("act", [F.silu, F.gelu], ids=["silu", "gelu"])
def test_forward_and_gradients_match_float64(act, n_threads):
    ws = weights()
    x = torch.randn(sum(COUNTS), C, requires_grad=True)
    dy = torch.randn(sum(COUNTS), C)
    y = threaded_glu_experts(x, ws, COUNTS, act, n_threads)
    grads = torch.autograd.grad(y, (x, *ws), dy)
    xd = x.detach().double().requires_grad_()
    wd = tuple(w.detach().double().requires_grad_() for w in ws)
    want = reference(xd, wd, act)
    want_grads = torch.autograd.grad(want, (xd, *wd), dy.double())
    torch.testing.assert_close(y.double(), want, atol=1e-5, rtol=1e-4)
    for got, ref in zip(grads, want_grads):
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-4)
    for g, n in enumerate(COUNTS):
        if n == 0:
            assert all(grad[g].abs().sum() == 0 for grad in grads[1:])


def test_thread_counts_give_bitwise_equal_results():
    ws = weights()
    x = torch.randn(sum(COUNTS), C, requires_grad=True)
    dy = torch.randn(sum(COUNTS), C)
    runs = []
    for n_threads in (1, 2, 4):
        y = threaded_glu_experts(x, ws, COUNTS, F.silu, n_threads)
        runs.append((y, *torch.autograd.grad(y, (x, *ws), dy)))
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))


def saved_activation_elements(fn, params: list[torch.Tensor]) -> int:
    """fp32 elements in the storages autograd keeps for fn's backward, the parameters' aside
    (each storage once: a group's rows are views of one tensor)."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    storages = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            storages[storage.data_ptr()] = storage.nbytes() // 4
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


class _CountGEMMs(TorchDispatchMode):
    """Counts mm / addmm calls (under a dispatch mode the ranges run on the calling thread)."""

    def __init__(self):
        super().__init__()
        self.gemms = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.gemms += func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out,
                               torch.ops.aten.addmm_.default)  # fmt: skip
        return func(*args, **(kwargs or {}))


# which of (x, W_gate, W_up, W_down) train -> GEMMs per group in backward
TRAINABLE = {
    "all": ((True, True, True, True), 6),  # dW_down, dh, dW_gate, dW_up, dx (mm + addmm)
    "frozen_input": ((False, True, True, True), 4),
    "only_down": ((False, False, False, True), 1),
    "only_input": ((True, False, False, False), 3),  # dh, dx (mm + addmm)
    "only_gate": ((False, True, False, False), 2),  # dh, dW_gate
    "only_up": ((False, False, True, False), 2),  # dh, dW_up
    "input_and_down": ((True, False, False, True), 4),
}


@pytest.mark.parametrize("case", TRAINABLE)
def test_backward_computes_only_the_gradients_asked_for(case):
    trainable, gemms_per_group = TRAINABLE[case]
    ws = weights()
    x = torch.randn(sum(COUNTS), C)
    dy = torch.randn(sum(COUNTS), C)
    with _CountGEMMs():  # the same (calling) thread as the counted run below: bitwise equal
        full = torch.autograd.grad(
            threaded_glu_experts(x.requires_grad_(), ws, COUNTS, F.silu, 2), (x, *ws), dy
        )
    inputs = [t.detach().requires_grad_(wanted) for t, wanted in zip((x, *ws), trainable)]
    with _CountGEMMs() as counter:
        y = threaded_glu_experts(inputs[0], tuple(inputs[1:]), COUNTS, F.silu, 2)
        counter.gemms = 0  # backward's only
        y.backward(dy)
    for t, wanted, want in zip(inputs, trainable, full):
        assert (t.grad is not None) == wanted
        if wanted:
            assert torch.equal(t.grad, want)
    assert counter.gemms == gemms_per_group * len(COUNTS)  # empty groups call them too


def test_it_keeps_two_hidden_activations_where_autograd_keeps_four():
    experts = GroupedExperts(len(COUNTS), C, F_, F.silu)
    experts.init_weights(InitStds(inner=0.2, value=0.2, out=0.2))
    x = torch.randn(sum(COUNTS), C)
    counts = torch.tensor(COUNTS)
    kept = {}
    for impl in ("threaded_mm", "loop"):
        experts.impl = impl
        kept[impl] = saved_activation_elements(
            lambda: experts(x, counts), list(experts.parameters())
        )
    M = sum(COUNTS)
    assert kept["threaded_mm"] == M * C + 2 * M * F_  # x, a = x W_gate, b = x W_up
    assert kept["loop"] == M * C + 4 * M * F_  # x, a, act(a), b, h = act(a) b


def test_an_activation_without_a_fused_backward_is_refused_and_experts_fall_back():
    ws = weights()
    x = torch.randn(sum(COUNTS), C)
    with pytest.raises(ValueError, match="no fused backward"):
        threaded_glu_experts(x, ws, COUNTS, F.relu)
    experts = GroupedExperts(len(COUNTS), C, F_, F.relu)
    experts.init_weights(InitStds(inner=0.2, value=0.2, out=0.2))
    experts.impl = "threaded_mm"  # the unfused threaded GEMMs
    y = experts(x, torch.tensor(COUNTS))
    want = reference(x, (experts.w_gate, experts.w_up, experts.w_down), F.relu)
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-4)


def test_bad_counts_are_refused_in_one_line():
    ws = weights()
    with pytest.raises(
        ValueError, match=r"9 group counts summing to 24 \(smallest 0\) for 9 groups and 23 rows"
    ):
        threaded_glu_experts(torch.randn(23, C), ws, COUNTS, F.silu)


def test_experts_run_under_inference_mode_as_generation_does():
    experts = GroupedExperts(len(COUNTS), C, F_, F.silu)
    experts.init_weights(InitStds(inner=0.2, value=0.2, out=0.2))
    x = torch.randn(sum(COUNTS), C)
    with torch.inference_mode():
        experts.impl = "threaded_mm"
        y = experts(x, torch.tensor(COUNTS))
        experts.impl = "loop"
        want = experts(x, torch.tensor(COUNTS))
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-4)
