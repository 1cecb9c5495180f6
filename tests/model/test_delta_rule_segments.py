"""The gated delta rule cut into segments whose incoming state is not known yet (the building
block of context parallelism for Gated DeltaNet and KDA, model/mixers/delta_rule.py
affine_chunk_gated_delta_rule): each segment's outputs and final state as affine maps of its
incoming state, combined in order, equal one call on the whole sequence: in float64 to 1e-10
(per-head and per-key-channel decay, documents starting inside segments and on a boundary, an
initial state, any chunk), and the float32 gradients through the combination equal autograd's
through the whole sequence."""

from __future__ import annotations

import itertools

import pytest
import torch

from model.mixers.delta_rule import (
    affine_chunk_gated_delta_rule,
    chunk_gated_delta_rule,
    combine_segments,
)
from model.mixers.masks import document_starts
from tests.model.test_gdn import DOCS, F64, inputs

# segment boundaries over T = 37: documents start at 5, 16 (a boundary) and 9, 24 (inside)
BOUNDS = [0, 7, 16, 29, 37]


def per_channel(q: torch.Tensor, seed: int = 4) -> torch.Tensor:
    """KDA's decay: one log-decay per key channel, (B, H, T, Dk)."""
    return -torch.rand(*q.shape, generator=torch.Generator().manual_seed(seed), dtype=q.dtype) * 0.7


def by_segments(q, k, v, g, beta, starts, chunk, state=None):
    """The whole sequence through its segments: (outputs (B, H, T, Dv), final state)."""
    parts = []
    for a, b in itertools.pairwise(BOUNDS):
        piece = [x[:, :, a:b] for x in (q, k, v, g, beta)]
        docs = starts[:, a:b] if starts is not None else None
        parts.append(affine_chunk_gated_delta_rule(*piece, doc_starts=docs, chunk=chunk))
    outputs, final = combine_segments(parts, state)
    return torch.cat(outputs, dim=2), final


@pytest.mark.parametrize("chunk", [4, 8, 64])
@pytest.mark.parametrize("decay", ["head", "channel"])
@pytest.mark.parametrize("docs", [False, True])
def test_segments_combined_in_order_equal_the_whole_sequence(chunk, decay, docs):
    q, k, v, g, beta = inputs()
    if decay == "channel":
        g = per_channel(q)
    starts = document_starts(DOCS) if docs else None
    state = torch.randn(2, 3, 8, 6, generator=torch.Generator().manual_seed(7), dtype=q.dtype)
    for initial in (None, state):
        whole, s_whole = chunk_gated_delta_rule(q, k, v, g, beta, initial, starts, chunk)
        got, s = by_segments(q, k, v, g, beta, starts, chunk, initial)
        torch.testing.assert_close(got, whole, **F64)
        torch.testing.assert_close(s, s_whole, **F64)


@pytest.mark.parametrize("decay", ["head", "channel"])
def test_gradients_through_the_segments_equal_the_whole_sequences(decay):
    q, k, v, g, beta = (x.float() for x in inputs())
    if decay == "channel":
        g = per_channel(q)
    starts = document_starts(DOCS)
    weights = torch.randn(2, 3, 37, 6, generator=torch.Generator().manual_seed(9))
    grads = []
    for segmented in (False, True):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
        if segmented:
            o, s = by_segments(*leaves, starts, 8)
        else:
            o, s = chunk_gated_delta_rule(*leaves, None, starts, 8)
        ((o * weights).sum() + s.square().sum()).backward()
        grads.append([x.grad for x in leaves])
    for name, got, want in zip(["q", "k", "v", "g", "beta"], grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)
