"""Expert parallelism (all-to-all dispatch) against the same layout without it, on gloo ranks.

EP=2 on 2 ranks, and EP=2 x expert-FSDP=2 on 4 ranks, must give the loss, router statistics and
gradients of EP=1 (experts sharded by plain FSDP), up to fp32 reduction order; gradients must
not grow with the EP degree, and the aux-loss-free bias must be the same on every rank and equal
to one process's after steps with gradient accumulation.
"""

from __future__ import annotations

import pytest
import torch

from tests.parallel.ranks import run_ranks
from tests.parallel.workers import dispatch_matches_local, gradients, small_model, train

pytestmark = pytest.mark.distributed


def moe_model():
    # 8 experts, top-2, 1 shared, first layer dense; aux loss + aux-loss-free bias both on
    return small_model("tiny_moe", **{"moe.expert_hidden": 32})


def _assert_same_gradients(got: dict, ref: dict) -> None:
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-6)
    assert torch.equal(got["load"], ref["load"])  # router statistics: the same token counts
    assert got["grads"].keys() == ref["grads"].keys()
    for name, grad in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_all_to_all_dispatch_handles_empty_experts_and_uneven_splits() -> None:
    # rank 0 sends nothing to experts 1 and 3; rank 1 sends nothing to rank 0's experts
    results = run_ranks(2, dispatch_matches_local, [[3, 0, 2, 0], [0, 0, 5, 1]])
    for result in results:
        for got, want in (result["y"], result["dx"]):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("world", "layout"),
    [
        (2, {}),  # experts split over 2 ranks, not sharded further
        (4, {}),  # EP=2 x expert FSDP=2
        (4, {"dp_replicate": 2}),  # HSDP: 2 replicas of EP=2
        (2, {"activation_checkpoint": "full"}),
        # context parallelism: each cp rank routes its own positions; the experts' gradients
        # reduce over dp_shard_mod_ep x cp (a forced sum on gloo)
        (4, {"cp": 2}),
    ],
)
def test_expert_parallel_gives_the_gradients_of_ep1(world: int, layout: dict) -> None:
    ep1 = run_ranks(world, gradients, moe_model(), layout)[0]
    ep2 = run_ranks(world, gradients, moe_model(), layout | {"ep": 2})
    _assert_same_gradients(ep2[0], ep1)
    single = gradients(0, moe_model(), {})
    # the same as one process too (the balance loss is per rank, so compare only the experts)
    assert ep1["load"].sum() == single["load"].sum()
    expert = "layers.1.ffn.experts.w_down"
    assert ep2[0]["grads"][expert].abs().sum() > 0


def test_aux_free_bias_is_identical_on_ranks_and_equals_one_process() -> None:
    single = train(0, moe_model(), {}, 3, 4)  # 4 micro-batches of 2
    results = run_ranks(2, train, moe_model(), {"ep": 2}, 3, 2)  # 2 ranks x 2 micro-batches
    bias = "layers.1.ffn.router.expert_bias"
    assert results[0]["final"][bias].abs().sum() > 0  # the bias moved
    assert torch.equal(results[0]["final"][bias], results[1]["final"][bias])
    assert torch.equal(results[0]["final"][bias], single["final"][bias])
    torch.testing.assert_close(results[0]["losses"], single["losses"], rtol=1e-4, atol=1e-5)
