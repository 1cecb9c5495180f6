"""Chunked (fused head + cross-entropy) loss against F.cross_entropy on materialized logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model.loss import IGNORE_INDEX, chunked_cross_entropy
from tests.model.helpers import tiny_config, tiny_model

# fp32 sums over <= 23 tokens and a 37-way softmax; the two sides differ only by summation order
ATOL = RTOL = 1e-5

N, C, V = 23, 16, 37


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, C, generator=g, requires_grad=True)
    w = (torch.randn(V, C, generator=g) * 0.5).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    targets[[0, 5, 6, 17, 22]] = IGNORE_INDEX  # ignored tokens, including the last one
    return h, w, targets


@pytest.mark.parametrize("chunk", [0, 1, 4, 5, 7, 23, 64])  # 4, 7 do not divide 23
def test_chunked_cross_entropy_matches_torch(chunk):
    h, w, targets = inputs()
    loss = chunked_cross_entropy(h, w, targets, chunk)
    gh, gw = torch.autograd.grad(loss, (h, w))

    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    want = F.cross_entropy(h2 @ w2.T, targets, ignore_index=-100)  # mean over non-ignored
    want_gh, want_gw = torch.autograd.grad(want, (h2, w2))

    torch.testing.assert_close(loss, want, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(gh, want_gh, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(gw, want_gw, atol=ATOL, rtol=RTOL)
    assert torch.equal(gh[[0, 5, 6, 17, 22]], torch.zeros(5, C))  # ignored tokens: no gradient


def test_chunked_cross_entropy_accepts_batched_shapes():
    h, w, targets = inputs(seed=1)
    h3, t3 = h[:22].reshape(2, 11, C), targets[:22].reshape(2, 11)
    got = chunked_cross_entropy(h3, w, t3, 4)
    want = F.cross_entropy((h[:22] @ w.T), targets[:22], ignore_index=-100)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_chunked_cross_entropy_in_bf16_stays_close():
    """bf16 hidden/weights: the logits are upcast to fp32 before the log-softmax."""
    h, w, targets = inputs(seed=2)
    got = chunked_cross_entropy(h.bfloat16(), w.bfloat16(), targets, 5)
    assert got.dtype == torch.float32
    want = F.cross_entropy(
        (h.bfloat16().double() @ w.bfloat16().double().T), targets, ignore_index=-100
    )
    # inputs are exact in both; only the bf16 matmul output rounding (2^-8 relative) differs
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("chunk", [0, 5, 7, 4096])
@pytest.mark.parametrize("tie", [False, True])
def test_transformer_loss_equals_cross_entropy_of_logits(chunk, tie):
    cfg = tiny_config(loss_chunk_tokens=chunk, tie_embeddings=tie)
    model = tiny_model(cfg)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (2, 9), generator=g)
    targets[0, :3] = IGNORE_INDEX
    targets[1, -1] = IGNORE_INDEX

    loss = model(tokens, targets)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    logits = model(tokens)
    want = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    want_grads = torch.autograd.grad(want, list(model.parameters()))

    torch.testing.assert_close(loss, want, atol=ATOL, rtol=RTOL)
    for (name, _), got_g, want_g in zip(model.named_parameters(), grads, want_grads):
        torch.testing.assert_close(got_g, want_g, atol=ATOL, rtol=RTOL, msg=name)
