"""Per-token target log-probabilities (`model(tokens, targets, per_token=True)`, what downstream
scoring sums over a continuation) against log_softmax of the full logits, chunked or not, with
packed documents and ignored targets, and against the training loss they must average to."""

from __future__ import annotations

import pytest
import torch

from model.loss import IGNORE_INDEX, target_log_probs
from model.presets import load_preset
from model.transformer import build_model

VOCAB, B, T = 97, 3, 24


def model_and_batch(chunk: int, **overrides):
    cfg = load_preset(
        "tiny", {"vocab_size": VOCAB, "n_layers": 2, "loss_chunk_tokens": chunk, **overrides}
    )
    model = build_model(cfg, seed=0).eval()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (B, T + 1), generator=g)
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    targets[0, :5] = IGNORE_INDEX  # a context: no target there
    targets[2, -3:] = IGNORE_INDEX  # padding
    return model, inputs, targets


def reference(model, inputs, targets, doc_ids=None) -> torch.Tensor:
    """The obvious way: every logit, log_softmax in fp64, gather; 0 where ignored."""
    with torch.no_grad():
        logits = model(inputs, doc_ids=doc_ids).double()
    safe = targets.clamp(min=0)
    picked = torch.log_softmax(logits, -1).gather(-1, safe[..., None])[..., 0]
    return torch.where(targets == IGNORE_INDEX, 0.0, picked).float()


@pytest.mark.parametrize("chunk", [0, 7, 512])
def test_per_token_log_probs_equal_log_softmax_of_the_full_logits(chunk):
    model, inputs, targets = model_and_batch(chunk)
    with torch.no_grad():
        got = model(inputs, targets, per_token=True)
    assert got.shape == (B, T) and got.dtype == torch.float32
    torch.testing.assert_close(got, reference(model, inputs, targets), rtol=1e-5, atol=1e-5)
    assert (got[targets == IGNORE_INDEX] == 0).all()
    assert (got[targets != IGNORE_INDEX] < 0).all()


def test_packed_documents_are_scored_as_the_model_reads_them():
    model, inputs, targets = model_and_batch(16)
    doc_ids = torch.zeros(B, T, dtype=torch.long)
    doc_ids[:, T // 2 :] = 1
    with torch.no_grad():
        got = model(inputs, targets, doc_ids=doc_ids, per_token=True)
        alone = model(inputs, targets, per_token=True)
    torch.testing.assert_close(
        got, reference(model, inputs, targets, doc_ids), rtol=1e-5, atol=1e-5
    )
    assert not torch.allclose(got[:, T // 2 :], alone[:, T // 2 :])  # the second document restarts


def test_their_mean_is_the_training_loss():
    model, inputs, targets = model_and_batch(7)
    with torch.no_grad():
        loss = model(inputs, targets)
        per_token = model(inputs, targets, per_token=True)
    counted = (targets != IGNORE_INDEX).sum()
    torch.testing.assert_close(-per_token.sum() / counted, loss, rtol=1e-6, atol=1e-6)


def test_bf16_autocast_runs_the_matmul_in_bf16_and_the_softmax_in_fp32():
    g = torch.Generator().manual_seed(1)
    h = torch.randn(10, 16, generator=g)
    w = torch.randn(VOCAB, 16, generator=g)
    targets = torch.randint(0, VOCAB, (10,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = target_log_probs(h, w, targets, 4)
    logits = (h.bfloat16() @ w.bfloat16().T).float()
    want = torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
