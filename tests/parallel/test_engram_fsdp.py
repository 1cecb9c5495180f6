"""Engram under FSDP2 (2 gloo ranks): the tables are row-sharded units of their own with dense
gradients, and training matches one process, where they have sparse gradients (row-wise Adam
gives the same update either way); with activation checkpointing, Muon, expert parallelism and an
HSDP checkpoint resumed on 2 ranks. Offloaded tables are refused with several ranks."""

from __future__ import annotations

import pytest
import torch

from model.errors import ConfigError
from tests.parallel.ranks import run_ranks
from tests.parallel.workers import engine_for, small_model, train

pytestmark = pytest.mark.distributed
STEPS = 4
TABLE = "layers.1.engram.table.weight"


def engram(**overrides):
    small = {"engram.layers": [1], "engram.heads": 2, "engram.dim": 32}
    return small_model("tiny_engram", **(small | {"engram.table_sizes": [97, 89]} | overrides))


def assert_same_training(got: dict, single: dict, muon: bool = False) -> None:
    if muon:  # as tests/parallel/test_muon_fsdp.py: reduction order flips bf16 roundings inside
        # Newton-Schulz, moving an update element by a bf16 step
        torch.testing.assert_close(got["losses"], single["losses"], rtol=1e-5, atol=1e-5)
        for name, tensor in single["final"].items():
            torch.testing.assert_close(got["final"][name], tensor, rtol=0, atol=5e-4, msg=name)
        return
    torch.testing.assert_close(got["losses"], single["losses"], rtol=2e-5, atol=2e-6)
    # the table's row gradients are summed in another order (sparse rows in one process, dense
    # per-rank sums reduce-scattered under FSDP2); Adam grows the rounding: observed 1.3e-5
    torch.testing.assert_close(got["norms"], single["norms"], rtol=5e-5, atol=0)
    for name, tensor in single["final"].items():
        torch.testing.assert_close(got["final"][name], tensor, rtol=1e-4, atol=5e-5, msg=name)


@pytest.mark.parametrize(
    ("layout", "optimizer"),
    [({}, "adamw"), ({"activation_checkpoint": "full"}, "adamw"), ({}, "muon")],
)
def test_engram_under_fsdp2_matches_one_process(layout: dict, optimizer: str) -> None:
    args = (STEPS, 1, "fp32", 1.0, "", "", optimizer)
    single = train(0, engram(), {}, *args)
    got = run_ranks(2, train, engram(), layout, *args)[0]
    assert_same_training(got, single, muon=optimizer == "muon")
    assert got["placements"][TABLE] == "(Shard(dim=0),)"
    assert not torch.equal(single["final"][TABLE], single["initial"][TABLE])  # trained


def test_engram_with_moe_under_expert_parallelism_matches_one_process() -> None:
    moe = {"moe.n_routed_experts": 4, "moe.top_k": 2, "moe.first_k_dense": 1}
    model = engram(**moe, **{"moe.expert_hidden": 32, "n_layers": 3})
    single = train(0, model, {}, 3)
    assert_same_training(run_ranks(2, train, model, {"ep": 2}, 3)[0], single)


def test_engram_hsdp_checkpoint_resumes_on_two_ranks(tmp_path) -> None:
    uninterrupted = train(0, engram(), {}, STEPS)
    hsdp = {"dp_replicate": 2, "dp_shard": 2}
    first = run_ranks(4, train, engram(), hsdp, 2, 1, "fp32", 1.0, "", str(tmp_path))[0]
    second = run_ranks(
        2, train, engram(), {}, 2, 1, "fp32", 1.0, str(tmp_path / "step_00000002"), ""
    )[0]
    losses = first["losses"] + second["losses"]
    torch.testing.assert_close(losses, uninterrupted["losses"], rtol=2e-5, atol=2e-6)
    for name, tensor in uninterrupted["final"].items():
        # (observed 1.4e-5 for the value projection: Adam on near-zero gradient entries)
        torch.testing.assert_close(second["final"][name], tensor, rtol=1e-4, atol=5e-5, msg=name)


def offloaded_engine(rank: int) -> str:
    try:
        engine_for(engram(**{"engram.offload": True}), {})
    except ConfigError as err:
        return str(err)
    return ""


def test_offloaded_tables_with_several_ranks_are_refused() -> None:
    assert "model.engram.offload=false" in run_ranks(2, offloaded_engine)[0]
