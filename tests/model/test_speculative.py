"""Self-speculative decoding with the MTP module: the output is the main model's greedy
continuation whatever the drafts (attention caches move back, recurrent and Engram states are
restored); a module trained on a predictable sequence gets its drafts accepted, so the main model
runs fewer forwards than it emits tokens."""

from __future__ import annotations

import pytest
import torch

from model import ModelConfig, build_model
from model.config import EngramConfig, GDNConfig, MTPConfig
from model.generate import generate
from model.mtp.speculative import speculative_generate
from optim.builder import build_optimizer
from optim.config import OptimConfig

V = 40


def model_with(depth=1, **kw):
    cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=2, mtp=MTPConfig(depth=depth), **kw)
    return build_model(cfg, seed=0).eval()


KINDS = {  # an attention model (KV caches), a hybrid and an Engram model (fixed-size states)
    "attention": {},
    "hybrid": {"layer_pattern": ["gdn", "gqa"], "gdn": GDNConfig(n_heads=2, head_dim=16)},
    "engram": {"engram": EngramConfig(layers=[0], heads=2, dim=16, table_sizes=[31, 37])},
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_output_is_the_greedy_continuation_when_drafts_are_rejected(kind):
    model = model_with(**KINDS[kind])
    prompt = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(0))
    expected = generate(model, prompt, 15, temperature=0)
    got, stats = speculative_generate(model, prompt, 15)
    assert torch.equal(got, expected)
    assert stats.drafted > 0 and stats.accepted < stats.drafted  # (an untrained module)


def test_eos_stops_and_bad_calls_are_refused():
    model = model_with()
    prompt = torch.randint(0, V, (1, 4), generator=torch.Generator().manual_seed(1))
    plain = generate(model, prompt, 12, temperature=0)
    eos = int(plain[0, 7])  # the fourth generated token
    got, _ = speculative_generate(model, prompt, 12, eos_id=eos)
    assert got[0, -1] == eos and torch.equal(got[0], plain[0, : got.shape[1]])
    with pytest.raises(ValueError, match="one sequence at a time"):
        speculative_generate(model, prompt.repeat(2, 1), 4)
    with pytest.raises(ValueError, match="model.mtp.depth is 0"):
        speculative_generate(model_with(depth=0), prompt, 4)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_trained_module_gets_its_drafts_accepted(kind):
    torch.manual_seed(0)
    model = model_with(**KINDS[kind]).train()
    period = torch.tensor([3, 17, 5, 29, 11, 8, 21])
    sequence = period.repeat(10)[None]  # (1, 70): every token predicts the next two
    optimizer = build_optimizer(OptimConfig(lr=1e-2, weight_decay=0.0), model)  # (sparse tables)
    for _ in range(60):
        loss = model(sequence[:, :-1], sequence[:, 1:])
        (loss + model.pop_mtp_objective()).backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    prompt = sequence[:, :9]
    got, stats = speculative_generate(model, prompt, 28)
    assert torch.equal(got, generate(model, prompt, 28, temperature=0))
    assert torch.equal(got[0], sequence[0, :37])  # learned the cycle
    assert stats.acceptance > 0.9 and stats.main_forwards < 16  # ~2 tokens per forward


def test_the_last_token_needs_no_room_for_a_draft():
    """With one token left, the main model reads `current` alone: a learned-position model at
    its exact length limit does not see a position past it."""
    model = model_with(position="learned", max_seq_len=12)
    prompt = torch.randint(0, V, (1, 5), generator=torch.Generator().manual_seed(2))
    got, _ = speculative_generate(model, prompt, 7)  # positions up to 11
    assert torch.equal(got, generate(model, prompt, 7, temperature=0))
