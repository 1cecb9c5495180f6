"""The direct padded route (model/moe/padded.py) against the general sort-dispatch-combine route:
the same numbers bit for bit, forward and every gradient, in fp32, bf16 and under bf16 autocast;
and the cases that must keep the general route."""

from __future__ import annotations

import pytest
import torch

from model.moe import MoE, local_dispatch
from model.moe import padded as padded_module
from model.moe.padded import padded_layout
from tests.model.test_moe_layer import LAYERS, inputs, make_layer

MODES = ("fp32", "bf16", "autocast")


def run(layer: MoE, x: torch.Tensor, g: torch.Tensor, mode: str) -> list[torch.Tensor]:
    """Output, input gradient and parameter gradients of one forward + backward."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
        y = layer(x)
    (y.float() * g).sum().backward()
    return [y, x.grad] + [p.grad for p in layer.parameters()]


def both_routes(layer: MoE, x: torch.Tensor, mode: str, monkeypatch) -> tuple[list, list]:
    taken = []
    real = padded_module.padded_route
    monkeypatch.setattr("model.moe.layer.padded_route", lambda *a: taken.append(1) or real(*a))
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    direct = run(layer, x, g, mode)
    assert taken, "the padded route was not taken"
    monkeypatch.setattr(MoE, "_routes_padded", lambda self, *a: False)
    general = run(layer, x, g, mode)
    return direct, general


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("config", list(LAYERS))
def test_the_padded_route_equals_the_general_route_bitwise(config, mode, monkeypatch):
    layer = make_layer(**LAYERS[config])
    layer.experts.impl = "padded_bmm"
    layer.router.expert_bias.copy_(0.05 * torch.randn(layer.n_experts))
    x = inputs(B=4, T=16)
    if mode == "bf16":
        layer.to(torch.bfloat16)
        x = x.bfloat16()
    direct, general = both_routes(layer, x, mode, monkeypatch)
    for a, b in zip(direct, general, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_an_idle_expert_and_uneven_loads_keep_the_route_exact(monkeypatch):
    layer = make_layer()
    layer.experts.impl = "padded_bmm"
    layer.router.expert_bias[3] = -100.0  # expert 3 never chosen: zero rows, zero gradient
    layer.router.expert_bias[5] = 1.0  # expert 5 chosen by most tokens: much padding elsewhere
    direct, general = both_routes(layer, inputs(B=4, T=16), "fp32", monkeypatch)
    for a, b in zip(direct, general, strict=True):
        assert torch.equal(a, b)
    assert layer.experts.w_gate.grad[3].abs().sum() == 0


def test_the_layout_puts_every_slot_in_its_experts_rows():
    idx = torch.tensor([[2, 0], [2, 1], [0, 2]])  # 3 tokens, k = 2
    order = torch.argsort(idx.flatten(), stable=True)
    counts = torch.bincount(idx.flatten(), minlength=4)  # [2, 1, 3, 0]
    layout = padded_layout(order, counts, k=2)
    assert layout.capacity == 3
    # expert e owns rows 3e .. 3e+2; slots in token order within an expert
    assert layout.row_of_slot.tolist() == [6, 0, 7, 3, 1, 8]
    assert layout.token_at_row.tolist() == [0, 2, 3, 1, 3, 3, 0, 1, 2, 3, 3, 3]  # 3: zero row


@pytest.mark.parametrize("case", ["capacity_dropping", "expert_parallel_dispatch", "loop_impl"])
def test_the_general_route_stays_where_the_padded_one_does_not_apply(case, monkeypatch):
    layer = make_layer(capacity_factor=1.0 if case == "capacity_dropping" else 0.0)
    if case == "expert_parallel_dispatch":
        layer.dispatch = lambda x_sorted, counts, experts: local_dispatch(x_sorted, counts, experts)
    if case == "loop_impl":
        layer.experts.impl = "loop"
    monkeypatch.setattr(
        "model.moe.layer.padded_route", lambda *a: pytest.fail("padded route taken")
    )
    layer(inputs())


def test_the_padded_route_calls_the_experts_module():
    """Engines that gather a module's weights around its call (DeepSpeed ZeRO-3) must see the
    experts called, not a method of theirs."""
    layer = make_layer()
    layer.experts.impl = "padded_bmm"
    calls = []
    layer.experts.register_forward_pre_hook(lambda module, args: calls.append(args[1]))
    layer(inputs())
    assert calls == [None]  # one call, with the padded block (no counts)


@pytest.mark.parametrize("capacity_factor", [0.0, 1.0])
def test_an_empty_batch_keeps_the_graph(capacity_factor):
    """No tokens (an empty micro-batch): an empty output still wired to the experts, so engines
    that run collectives in backward (expert parallelism's all-to-all) still run them."""
    layer = make_layer(capacity_factor=capacity_factor)
    x = torch.zeros(2, 0, 32, requires_grad=True)
    y = layer(x)
    assert y.shape == (2, 0, 32) and y.requires_grad
    y.sum().backward()
    assert x.grad.shape == x.shape
