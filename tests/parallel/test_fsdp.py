"""FSDP2 and HSDP on gloo ranks against one process: same initial weights (exactly), the same
losses, gradient norms and final weights (within fp32 reduction-order tolerance)."""

from __future__ import annotations

import pytest
import torch

from tests.parallel.ranks import run_ranks
from tests.parallel.workers import small_model, train

pytestmark = pytest.mark.distributed
STEPS = 4
# fp32: a sharded run sums the same numbers in another order (per-rank means, reduce-scatter)
RTOL, ATOL = 2e-5, 2e-6


@pytest.fixture(scope="module")
def single() -> dict:
    return train(0, small_model(), {}, STEPS)


def _assert_same_run(got: dict, ref: dict) -> None:
    assert got["initial"].keys() == ref["initial"].keys()
    for name, tensor in ref["initial"].items():
        assert torch.equal(got["initial"][name], tensor), f"initial {name} differs"
    torch.testing.assert_close(got["losses"], ref["losses"], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got["norms"], ref["norms"], rtol=1e-4, atol=1e-6)
    for name, tensor in ref["final"].items():
        torch.testing.assert_close(got["final"][name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    assert ref["losses"][-1] < ref["losses"][0]  # it did train


def test_fsdp_two_ranks_matches_one_process(single: dict) -> None:
    results = run_ranks(2, train, small_model(), {}, STEPS)
    _assert_same_run(results[0], single)
    assert results[0]["losses"] == results[1]["losses"]  # every rank logs the same value
    assert results[0]["placements"]["layers.0.attn.q_proj.weight"] == "(Shard(dim=0),)"
    assert results[0]["placements"]["embed.weight"] == "(Shard(dim=0),)"


def test_hsdp_two_by_two_with_accumulation_matches_one_process(single: dict) -> None:
    # 2 micro-batches: reduce-scatter after each, all-reduce across replicas after the last
    results = run_ranks(4, train, small_model(), {"dp_replicate": 2, "dp_shard": 2}, STEPS, 2)
    _assert_same_run(results[0], single)
    placement = results[0]["placements"]["layers.1.ffn.down_proj.weight"]
    assert placement == "(Replicate(), Shard(dim=0))"
    # ranks 0 and 2 hold the same shard in the two replicas: it must stay bitwise identical
    for name, shard in results[0]["local"].items():
        assert torch.equal(shard, results[2]["local"][name]), name


def test_fsdp_gradient_accumulation_matches_one_process(single: dict) -> None:
    # 2 ranks x 2 micro-batches of 2 sequences: the same global batch of 8
    results = run_ranks(2, train, small_model(), {}, STEPS, 2)
    _assert_same_run(results[0], single)


def test_compiled_blocks_and_loss_under_fsdp_match_one_eager_process(single: dict) -> None:
    """trainer.compile=true on 2 ranks: FSDP2's hooks between compiled blocks (Inductor's CPU
    options: C++ graphs), the loss compiled per chunk. fp32: within Inductor's reordering."""
    results = run_ranks(
        2, train, small_model(), {}, STEPS, 1, "fp32", 1.0, "", "", "adamw", 0.0, True
    )
    torch.testing.assert_close(results[0]["losses"], single["losses"], rtol=1e-4, atol=1e-5)
    for name, tensor in single["final"].items():
        torch.testing.assert_close(
            results[0]["final"][name], tensor, rtol=1e-3, atol=1e-4, msg=name
        )
    assert results[0]["losses"] == results[1]["losses"]


def test_activation_checkpointing_changes_nothing(single: dict) -> None:
    for mode in ("full", "selective"):
        got = train(0, small_model(), {"activation_checkpoint": mode}, STEPS)
        torch.testing.assert_close(got["losses"], single["losses"], rtol=1e-6, atol=1e-7)
