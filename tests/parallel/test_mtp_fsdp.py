"""Multi-token prediction through the engine: lambda = 0 trains the main model bitwise as
without MTP; under FSDP2 (2 gloo ranks, also with activation checkpointing), with a MoE MTP
block under expert parallelism, and across an HSDP checkpoint resumed on 2 ranks, training
matches one process (the shared embedding and head are used by the root and by the modules)."""

from __future__ import annotations

import pytest
import torch

from tests.parallel.ranks import run_ranks
from tests.parallel.workers import small_model, train

pytestmark = pytest.mark.distributed
STEPS = 4


def mtp(depth: int = 1, **overrides):
    return small_model("tiny", **({"mtp.depth": depth} | overrides))


def test_lambda_zero_is_bitwise_the_run_without_mtp() -> None:
    plain = train(0, small_model("tiny"), {}, STEPS)
    off = train(0, mtp(**{"mtp.weight": 0.0, "mtp.final_weight": 0.0}), {}, STEPS)
    assert off["losses"] == plain["losses"] and off["norms"] == plain["norms"]
    for name, tensor in plain["final"].items():
        assert torch.equal(off["final"][name], tensor), name


def assert_same(got: dict, single: dict) -> None:
    torch.testing.assert_close(got["losses"], single["losses"], rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(got["norms"], single["norms"], rtol=1e-5, atol=0)
    for name, tensor in single["final"].items():
        torch.testing.assert_close(got["final"][name], tensor, rtol=1e-4, atol=5e-5, msg=name)


@pytest.mark.parametrize(("depth", "layout"), [(1, {}), (2, {"activation_checkpoint": "full"})])
def test_mtp_under_fsdp2_matches_one_process(depth: int, layout: dict) -> None:
    single = train(0, mtp(depth), {}, STEPS)
    got = run_ranks(2, train, mtp(depth), layout, STEPS)[0]
    assert_same(got, single)
    name = "mtp.layers.0.eh_proj.weight"
    assert got["placements"][name] == "(Shard(dim=0),)"
    assert not torch.equal(single["final"][name], single["initial"][name])  # trained


def test_a_moe_mtp_block_under_expert_parallelism_matches_one_process() -> None:
    moe = {"moe.n_routed_experts": 4, "moe.top_k": 2, "moe.expert_hidden": 32}
    model = mtp(1, **moe, **{"moe.aux_loss_coef": 0.01})
    single = train(0, model, {}, 3)
    got = run_ranks(2, train, model, {"ep": 2}, 3)[0]
    # the tolerance of tests/parallel/test_expert_parallel.py (per-rank balance losses)
    torch.testing.assert_close(got["losses"], single["losses"], rtol=1e-4, atol=1e-5)
    experts = "mtp.layers.0.block.ffn.experts.w_gate"
    assert got["placements"][experts] != "local"  # the MTP block's experts are split too
    assert not torch.equal(single["final"][experts], single["initial"][experts])


def test_mtp_hsdp_checkpoint_resumes_on_two_ranks(tmp_path) -> None:
    uninterrupted = train(0, mtp(), {}, STEPS)
    hsdp = {"dp_replicate": 2, "dp_shard": 2}
    first = run_ranks(4, train, mtp(), hsdp, 2, 1, "fp32", 1.0, "", str(tmp_path))[0]
    second = run_ranks(2, train, mtp(), {}, 2, 1, "fp32", 1.0, str(tmp_path / "step_00000002"), "")[
        0
    ]
    torch.testing.assert_close(
        first["losses"] + second["losses"], uninterrupted["losses"], rtol=2e-5, atol=2e-6
    )
    for name, tensor in uninterrupted["final"].items():
        torch.testing.assert_close(second["final"][name], tensor, rtol=1e-4, atol=5e-5, msg=name)
