"""Length packing of downstream requests: every request once, within the token budget (a longer
request alone), and with fixed shapes (compiled FlexAttention) few distinct (rows, width)."""

from __future__ import annotations

import random

import torch

from model.loss import IGNORE_INDEX
from trainer.downstream.batches import batch_tensors, pack
from trainer.downstream.tasks import Request


def requests(n: int = 200, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(3, 300)
        cont = rng.randint(1, min(length, 20))
        tokens = [rng.randrange(50) for _ in range(length)]
        out.append(Request(tokens, length - cont, [*tokens[length - cont + 1 :], 7]))
    return out


def test_tight_packing_scores_every_request_once_within_the_budget():
    reqs = requests()
    batches = pack(reqs, 1000)
    seen = sorted(i for b in batches for i in b.indices)
    assert seen == list(range(len(reqs)))
    for b in batches:
        assert b.rows == len(b.indices) and b.width == max(len(reqs[i].tokens) for i in b.indices)
        assert b.tokens <= 1000 or len(b.indices) == 1
    assert [b.width for b in batches] == sorted((b.width for b in batches), reverse=True)
    padding = sum(b.tokens for b in batches) / sum(len(r.tokens) for r in reqs) - 1
    assert padding < 0.1  # sorted by length: little padding


def test_a_request_longer_than_the_budget_goes_alone():
    reqs = requests()
    batches = pack(reqs, 100)
    assert all(len(b.indices) == 1 for b in batches if b.width > 50)


def test_fixed_shapes_bound_the_distinct_shapes():
    reqs = requests()
    batches = pack(reqs, 2048, width_multiple=128)
    longest = max(len(r.tokens) for r in reqs)
    shapes = {(b.rows, b.width) for b in batches}
    assert {w for _, w in shapes} <= {128, 256, longest}
    assert len(shapes) == len({w for _, w in shapes})  # one row count per width
    assert sorted(i for b in batches for i in b.indices) == list(range(len(reqs)))


def test_batch_tensors_target_each_continuation_after_its_context():
    reqs = requests(12)
    batches = pack(reqs, 2_000, width_multiple=128)
    assert any(b.rows > len(b.indices) for b in batches)  # some rows only fill the shape
    for batch in batches:
        inputs, targets = batch_tensors(reqs, batch, pad_id=99)
        assert inputs.shape == targets.shape == (batch.rows, batch.width)
        for row, index in enumerate(batch.indices):
            r = reqs[index]
            scored = targets[row] != IGNORE_INDEX
            assert scored.nonzero()[:, 0].tolist() == list(range(r.start, len(r.tokens)))
            assert targets[row, scored].tolist() == r.continuation
            assert torch.equal(inputs[row, : len(r.tokens)], torch.tensor(r.tokens))
            assert inputs[row, len(r.tokens) :].eq(99).all()
        assert (targets[len(batch.indices) :] == IGNORE_INDEX).all()  # filling rows score nothing
