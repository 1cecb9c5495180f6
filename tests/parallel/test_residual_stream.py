"""A parametrised residual stream (the toy in tests/parallel/toy_stream.py) carries a tuple
between blocks, has parameters in the blocks and at the model level, and trains under FSDP2
with activation checkpointing equal to one process."""

from __future__ import annotations

import pytest
import torch

from model.transformer import build_model
from tests.parallel.ranks import run_ranks
from tests.parallel.toy_stream import NAME, train_toy
from tests.parallel.workers import small_model

STEPS = 4
RTOL, ATOL = 2e-5, 2e-6  # fp32, sums in another order (as tests/parallel/test_fsdp.py)


def test_the_toy_stream_at_init_is_the_pre_norm_model():
    toy = build_model(small_model(residual=NAME), seed=0).eval()
    pre = build_model(small_model(), seed=0).eval()
    shared = pre.state_dict()
    assert set(shared) < set(toy.state_dict())  # the toy adds only its own parameters
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(toy(tokens), pre(tokens))
        cache_toy, cache_pre = toy.new_cache(2, 20), pre.new_cache(2, 20)
        toy(tokens, cache=cache_toy), pre(tokens, cache=cache_pre)
        nxt = tokens[:, :1]
        assert torch.equal(toy(nxt, cache=cache_toy), pre(nxt, cache=cache_pre))  # decoding


@pytest.fixture(scope="module")
def single() -> dict:
    return train_toy(0, small_model(residual=NAME), {}, STEPS)


@pytest.mark.distributed
@pytest.mark.parametrize("checkpointing", ["full", "selective"])
def test_the_toy_stream_trains_under_fsdp2_with_checkpointing_like_one_process(
    single: dict, checkpointing: str
) -> None:
    layout = {"activation_checkpoint": checkpointing}
    results = run_ranks(2, train_toy, small_model(residual=NAME), layout, STEPS)
    got = results[0]
    torch.testing.assert_close(got["losses"], single["losses"], rtol=RTOL, atol=ATOL)
    for name, tensor in single["final"].items():
        torch.testing.assert_close(got["final"][name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    # the stream's own parameters were sharded and trained, in the blocks and at the root
    assert got["placements"]["layers.0.attn_residual.scale"] == "(Shard(dim=0),)"
    assert got["placements"]["stream.mix"] == "(Shard(dim=0),)"
    for name in ("layers.1.ffn_residual.scale", "stream.mix"):
        assert not torch.equal(single["final"][name], single["initial"][name]), name
    assert single["losses"][-1] < single["losses"][0]


def test_the_toy_stream_compiles_per_block_like_eager():
    """trainer.compile=true compiles every block: the tuple state crosses compiled blocks."""
    from tests.parallel.workers import engine_for, global_batches, local_batch
    from trainer.hooks import start_hooks
    from trainer.step import LossTracker, StepSettings, train_step

    cfg = small_model(residual=NAME)
    runs = {}
    for compiled in (False, True):
        engine = engine_for(cfg, {}, compile=compiled)
        tracker, settings = LossTracker(0.0), StepSettings(grad_clip=1.0)
        hooks = start_hooks(engine, 0.0, None)
        runs[compiled] = [
            train_step(engine, local_batch(t), settings, tracker, hooks).loss
            for t in global_batches(3, cfg.vocab_size)
        ]
    torch.testing.assert_close(runs[True], runs[False], rtol=1e-4, atol=1e-5)
