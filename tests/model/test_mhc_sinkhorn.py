"""The eager Sinkhorn (model/residual/mhc_sinkhorn.py) against the recipe (model.residual.mhc.sinkhorn): the same
forward bit for bit, gradients as close to float64 as autograd's through the recipe, a layout
that keeps matmul on its fast path, the caller's gradient left alone, only the logits kept."""

from __future__ import annotations

import pytest
import torch

from model.residual import mhc
from model.residual.mhc import HyperConnection, sinkhorn
from model.residual.mhc_sinkhorn import sinkhorn_tokens_last

SHAPES = [(8, 64, 4, 4), (2, 3, 4, 4), (1, 1, 4, 4), (5, 3, 3), (4, 2, 2)]


def logits_of(shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype) * 3


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("iters", [1, 2, 20])
def test_the_forward_equals_the_recipe_bitwise(shape, iters):
    logits = logits_of(shape)
    assert torch.equal(sinkhorn_tokens_last(logits, iters, 1e-6), sinkhorn(logits, iters, 1e-6))


@pytest.mark.parametrize("shape", SHAPES)
def test_gradients_are_as_close_to_float64_as_autograds_through_the_recipe(shape):
    logits, upstream = logits_of(shape), logits_of(shape, seed=1, dtype=torch.float64)
    exact = logits.double().requires_grad_()
    sinkhorn(exact, 20, 1e-6).backward(upstream)
    recipe = logits.clone().requires_grad_()
    sinkhorn(recipe, 20, 1e-6).backward(upstream.float())
    ours = logits.clone().requires_grad_()
    sinkhorn_tokens_last(ours, 20, 1e-6).backward(upstream.float())
    recipe_error = (recipe.grad.double() - exact.grad).abs().max()
    our_error = (ours.grad.double() - exact.grad).abs().max()
    assert our_error <= max(2 * recipe_error, 1e-7), (our_error, recipe_error)


def test_gradients_in_float64_equal_the_recipes():
    logits = logits_of((3, 5, 4, 4), dtype=torch.float64).requires_grad_()
    upstream = logits_of((3, 5, 4, 4), seed=2, dtype=torch.float64)
    expected = torch.autograd.grad(sinkhorn(logits, 20, 1e-6), logits, upstream)[0]
    got = torch.autograd.grad(sinkhorn_tokens_last(logits, 20, 1e-6), logits, upstream)[0]
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)


def test_the_output_is_contiguous_in_the_logits_layout():
    # a strided output sent the streams' mixing matmul to bmm's per-matrix loop (2,048 selects
    # and copies per call: the whole mHC step 1.5x slower)
    out = sinkhorn_tokens_last(logits_of((2, 16, 4, 4)), 20, 1e-6)
    assert out.is_contiguous()


def test_the_callers_gradient_is_not_written_to():
    logits = logits_of((1, 1, 4, 4)).requires_grad_()  # one token: the layouts coincide
    upstream = logits_of((1, 1, 4, 4), seed=3)
    kept = upstream.clone()
    sinkhorn_tokens_last(logits, 20, 1e-6).backward(upstream)
    assert torch.equal(upstream, kept)


def test_only_the_logits_are_kept_for_backward():
    saved = []

    def pack(tensor):
        saved.append(tensor.numel())
        return tensor

    logits = logits_of((2, 8, 4, 4)).requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        sinkhorn_tokens_last(logits, 20, 1e-6)
    assert saved == [logits.numel()]  # the recipe keeps 2 x 20 such tensors


def test_the_connection_takes_it_in_eager_mode_and_keeps_its_gradients(monkeypatch):
    connection = HyperConnection(8, 4, iters=20, eps=1e-6, norm_eps=1e-6, recompute=False)
    with torch.no_grad():
        for p in connection.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    x = torch.randn(2, 5, 4, 8, requires_grad=True)
    assert "SinkhornTokensLast" in type(connection.maps(x)[2].grad_fn).__name__

    def grads():
        connection.zero_grad()
        x.grad = None
        out = connection(x, lambda h: h * 2, torch.nn.Identity())
        out.square().sum().backward()
        return [x.grad, *(p.grad for p in connection.parameters())]

    ours = grads()
    monkeypatch.setattr(mhc, "sinkhorn_tokens_last", sinkhorn)  # the recipe through autograd
    recipe = grads()
    for got, expected in zip(ours, recipe, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_no_steps_is_refused():
    with pytest.raises(ValueError, match="at least one step"):
        sinkhorn_tokens_last(logits_of((1, 2, 4, 4)), 0, 1e-6)
