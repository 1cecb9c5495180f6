"""Chunked (fused head + cross-entropy) loss against F.cross_entropy on materialized logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model.loss import IGNORE_INDEX, chunked_cross_entropy, loss_chunk, loss_chunk_fusable
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


CHUNK_FNS = pytest.mark.parametrize("chunk_fn", [loss_chunk, loss_chunk_fusable])


@CHUNK_FNS
@pytest.mark.parametrize("chunk", [0, 1, 4, 5, 7, 23, 64])  # 4, 7 do not divide 23
def test_chunked_cross_entropy_matches_torch(chunk, chunk_fn):
    h, w, targets = inputs()
    loss = chunked_cross_entropy(h, w, targets, chunk, chunk_fn)
    gh, gw = torch.autograd.grad(loss, (h, w))

    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    want = F.cross_entropy(h2 @ w2.T, targets, ignore_index=-100)  # mean over non-ignored
    want_gh, want_gw = torch.autograd.grad(want, (h2, w2))

    torch.testing.assert_close(loss, want, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(gh, want_gh, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(gw, want_gw, atol=ATOL, rtol=RTOL)
    assert torch.equal(gh[[0, 5, 6, 17, 22]], torch.zeros(5, C))  # ignored tokens: no gradient


def test_the_gradients_follow_the_incoming_scale_and_stay_apart_from_the_saved_ones():
    """backward scales the stored dh, dW by the incoming gradient: (loss / 3) gives a third of
    them, exactly. A retained graph's second backward gives the same gradients again after the
    first ones were changed in place (.grad never aliases what the graph holds)."""
    h, w, targets = inputs()
    loss = chunked_cross_entropy(h, w, targets, 5)
    loss.backward(retain_graph=True)
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad.mul_(0.0)
    w.grad.mul_(0.0)
    loss.backward()
    assert torch.equal(h.grad, gh) and torch.equal(w.grad, gw)
    h.grad = w.grad = None
    (chunked_cross_entropy(h, w, targets, 5) / 3).backward()
    third = torch.ones(()) / 3
    assert torch.equal(h.grad, gh * third) and torch.equal(w.grad, gw * third)


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


@CHUNK_FNS
def test_loss_stays_exact_where_the_target_probability_underflows(chunk_fn):
    """Logits spread over thousands: the targets' softmax probabilities underflow to 0 in fp32,
    yet the loss (logsumexp from the largest probability, or from the max and the sum of
    exponentials) equals the fp64 cross-entropy."""
    h, w, targets = inputs(seed=4)
    w = (w.detach() * 400).requires_grad_()
    got = chunked_cross_entropy(h, w, targets, 5, chunk_fn)
    want = F.cross_entropy(h.double() @ w.double().T, targets, ignore_index=-100)
    assert torch.isfinite(got) and want > 200
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)


def test_autocast_returns_the_fp32_weight_gradient_unrounded():
    """Under bf16 autocast the head matmuls run in bf16, but the fp32 weight's gradient is the
    fp32 sum, not a bf16-rounded one: it matches the fp64 gradient of the same bf16 inputs
    better than bf16 rounding allows."""
    h, w, targets = inputs(seed=5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = chunked_cross_entropy(h, w, targets, 7)
    (grad_w,) = torch.autograd.grad(loss, (w,))
    assert grad_w.dtype == torch.float32
    hb, wb = h.detach().bfloat16().double(), w.detach().bfloat16().double().requires_grad_()
    (want,) = torch.autograd.grad(F.cross_entropy(hb @ wb.T, targets, ignore_index=-100), (wb,))
    assert not torch.equal(grad_w, grad_w.bfloat16().float())  # more bits than bf16 holds
    # dlogits go through bf16 for the matmul (2^-9 relative each)
    torch.testing.assert_close(grad_w.double(), want, rtol=2e-2, atol=2e-3)


def test_the_fusable_chunk_equals_loss_chunk_in_bf16():
    """The compiled form against the eager one on bf16 inputs (the matmul dtype under
    autocast), a (64, 1000) chunk with ignored targets: the loss to fp32 rounding, dlogits (and
    so both gradients) within one bf16 rounding of softmax's own, ignored rows zero in both."""
    g = torch.Generator().manual_seed(7)
    h = torch.randn(64, 32, generator=g).bfloat16()
    w = (torch.randn(1000, 32, generator=g) * 0.5).bfloat16()
    t = torch.randint(0, 1000, (64,), generator=g)
    t[[3, 40]] = IGNORE_INDEX
    valid, count = t != IGNORE_INDEX, torch.tensor(62)
    loss, gh, gw = loss_chunk(h, w, t, valid, count, torch.zeros(1000, 32))
    loss2, gh2, gw2 = loss_chunk_fusable(h, w, t, valid, count, torch.zeros(1000, 32))
    torch.testing.assert_close(loss2, loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(gh2, gh, rtol=1e-2, atol=1e-5)
    torch.testing.assert_close(gw2.float(), gw.float(), rtol=1e-2, atol=1e-5)
    assert torch.equal(gh2[[3, 40]], torch.zeros(2, 32))
    assert not torch.equal(gh2, torch.zeros_like(gh2))
    no_grad = loss_chunk_fusable(h, w, t, valid, count, None)
    assert torch.equal(no_grad[0], loss2) and no_grad[1:] == (None, None)


def test_normalizer_from_the_largest_probability_equals_logsumexp():
    """One dominant logit, a flat row, and a 128k-wide row: logsumexp to fp32 rounding plus the
    error of the softmax's own normalizer (log of the sum torch.softmax divided by, against the
    true one: what its probabilities sum to, minus 1). That error is the CPU kernel's: 1e-7
    with AVX512, 3.4e-5 with AVX2 on the 128k row (torch.softmax's probabilities there are off by
    up to 3.6e-5 relative too)."""
    from model.loss import normalizer_and_softmax

    g = torch.Generator().manual_seed(6)
    rows = torch.randn(3, 128256, generator=g) * 4
    rows[0, 17] = 300.0  # one logit dominates: the largest probability is ~1
    rows[1] = 2.5  # flat: the largest probability is 1/V
    lse, probs = normalizer_and_softmax(rows.clone())
    exact = torch.logsumexp(rows.double(), -1)
    softmax_error = (probs.double().sum(-1) - 1).abs()  # = |log(S'/S)| to first order
    assert ((lse.double() - exact).abs() <= 1.1 * softmax_error + 1e-6 * exact.abs()).all()
    torch.testing.assert_close(probs, torch.softmax(rows, -1), rtol=0, atol=0)


@pytest.mark.parametrize("chunk", [0, 4])
def test_evaluation_computes_the_loss_without_its_gradients(chunk, monkeypatch):
    """Under no_grad the loss is the training forward's, bitwise, and no gradient is built: an
    autograd Function's needs_input_grad follows requires_grad even under no_grad, so going
    through it cost every evaluation two extra head GEMMs per chunk."""
    import model.loss as loss_module

    h, w, targets = inputs()
    training = chunked_cross_entropy(h, w, targets, chunk)
    built = []
    real = loss_module.chunked_loss

    def recording(*args, want_grad):
        built.append(want_grad)
        return real(*args, want_grad=want_grad)

    monkeypatch.setattr(loss_module, "chunked_loss", recording)
    with torch.no_grad():
        evaluation = chunked_cross_entropy(h, w, targets, chunk)
    assert built == [False]
    assert torch.equal(evaluation, training.detach())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        training = chunked_cross_entropy(h, w, targets, chunk)
        with torch.no_grad():
            evaluation = chunked_cross_entropy(h, w, targets, chunk)
    assert built == [False, True, False]
    assert torch.equal(evaluation, training.detach())
