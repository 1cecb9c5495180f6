"""Engram under FSDP2 (2 gloo ranks): the tables are row-sharded units of their own with dense
gradients, and training matches one process, where they have sparse gradients (row-wise Adam
gives the same update either way); with activation checkpointing, Muon, expert parallelism and an
HSDP checkpoint resumed on 2 ranks. Offloaded tables are refused with several ranks."""

from __future__ import annotations

import pytest
import torch

from model.errors import ConfigError
from tests.parallel.ranks import run_ranks
from tests.parallel.workers import engine_for, gradients, small_model, train

pytestmark = pytest.mark.distributed
STEPS = 4
TABLE = "layers.1.engram.table.weight"


def engram(**overrides):
    small = {"engram.layers": [1], "engram.heads": 2, "engram.dim": 32}
    return small_model("tiny_engram", **(small | {"engram.table_sizes": [97, 89]} | overrides))


def assert_same_training(got: dict, single: dict, muon: bool = False) -> None:
    """Losses to 2e-5. The weights: Adam moves an entry by about lr whatever the size of its
    gradient, so entries whose gradient is near zero at the start (the gate's norms and keys:
    ~1e-6, their rounding differences ~1e-10) may step either way: observed up to 3e-3 = lr after
    4 steps, and the gradient norm then differs by up to 1% at step 4, while the first step's
    gradients agree to 1e-9 (`test_one_steps_gradients_match_one_process`). Muon (as
    tests/parallel/test_muon_fsdp.py): reduction order flips bf16 roundings in Newton-Schulz."""
    atol = 1e-5 if muon else 2e-6
    torch.testing.assert_close(got["losses"], single["losses"], rtol=2e-5, atol=atol)
    assert_weights_close(got["final"], single["final"])


def assert_weights_close(got: dict, expected: dict) -> None:
    """Within two Adam steps of lr = 3e-3 (see assert_same_training)."""
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=2 * 3e-3, msg=name)


def test_one_steps_gradients_match_one_process() -> None:
    """Dense row-sharded table gradients (FSDP2) = the sparse ones of one process, and every
    other gradient, to rounding."""
    single = gradients(0, engram(), {})
    got = run_ranks(2, gradients, engram(), {})[0]
    torch.testing.assert_close(got["loss"], single["loss"], rtol=1e-6, atol=0)
    for name, grad in single["grads"].items():
        dense = grad.to_dense() if grad.is_sparse else grad
        torch.testing.assert_close(got["grads"][name], dense, rtol=1e-5, atol=1e-8, msg=name)


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


@pytest.mark.parametrize("layout", [{}, {"dp_replicate": 2, "dp_shard": 1}])
def test_replicated_tables_average_their_sparse_rows_and_match_one_process(layout) -> None:
    """sharding=replicated: every rank holds the whole table (no FSDP2 unit, no gather) and the
    ranks' sparse row gradients are averaged; the same training as one process."""
    model = engram(**{"engram.sharding": "replicated"})
    single = train(0, model, {}, STEPS)
    got = run_ranks(2, train, model, layout, STEPS)[0]
    assert_same_training(got, single)
    assert got["placements"][TABLE] == "local"  # whole on each rank
    assert not torch.equal(got["final"][TABLE], got["initial"][TABLE])


def test_engram_with_moe_under_expert_parallelism_matches_one_process() -> None:
    moe = {"moe.n_routed_experts": 4, "moe.top_k": 2, "moe.first_k_dense": 1}
    model = engram(**moe, **{"moe.expert_hidden": 32, "n_layers": 3})
    single = train(0, model, {}, 3)
    assert_same_training(run_ranks(2, train, model, {"ep": 2}, 3)[0], single)


@pytest.mark.parametrize("sharding", ["rows", "replicated"])
def test_engram_hsdp_checkpoint_resumes_on_two_ranks(tmp_path, sharding: str) -> None:
    model = engram(**{"engram.sharding": sharding})
    uninterrupted = train(0, model, {}, STEPS)
    hsdp = {"dp_replicate": 2, "dp_shard": 2}
    first = run_ranks(4, train, model, hsdp, 2, 1, "fp32", 1.0, "", str(tmp_path))[0]
    second = run_ranks(2, train, model, {}, 2, 1, "fp32", 1.0, str(tmp_path / "step_00000002"), "")[
        0
    ]
    losses = first["losses"] + second["losses"]
    torch.testing.assert_close(losses, uninterrupted["losses"], rtol=2e-5, atol=2e-6)
    assert_weights_close(second["final"], uninterrupted["final"])


def offloaded_engine(rank: int) -> str:
    try:
        engine_for(engram(**{"engram.offload": True}), {})
    except ConfigError as err:
        return str(err)
    return ""


def test_offloaded_tables_with_several_ranks_are_refused() -> None:
    assert "model.engram.offload=false" in run_ranks(2, offloaded_engine)[0]
