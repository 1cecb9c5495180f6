"""The trainer's engine with parallel.tp on gloo ranks against one process (fp32, AdamW or Muon,
the training hooks: MoE balancing, MTP, ...): the same initial weights, losses, gradient norms
and final weights for every preset family, each built as the trainer builds it (tensor
parallelism, then FSDP2 over the data-parallel ranks of the same root mesh)."""

from __future__ import annotations

import pytest
import torch

from tests.parallel.ranks import run_ranks
from tests.parallel.workers import small_model, train

pytestmark = pytest.mark.distributed
STEPS = 3
# fp32: tp ranks sum partial products (row-wise projections, the vocab-parallel loss) in another
# order than one process. AdamW's update m / sqrt(v) of a gradient near 0 turns that rounding into
# up to lr per step on single elements (measured after 3 steps at lr 3e-3: 1.1e-4 on one weight
# of 12,288, 1.4e-4 in norm on mHC's stream mixing), so the final weights compare elementwise to
# WEIGHT_ATOL, 5% of the largest change AdamW can make in the run (3 x lr); the losses and
# gradient norms, which would show a wrong gradient, compare tightly
RTOL, ATOL = 2e-5, 2e-6
WEIGHT_ATOL = 0.05 * STEPS * 3e-3

CASES = {
    "mla": (small_model("tiny_mla"), "adamw"),
    "gdn": (small_model("tiny_hybrid", n_layers=4), "adamw"),
    "kda": (small_model("tiny_kda", n_layers=4), "adamw"),
    "moe": (small_model("tiny_moe"), "adamw"),  # shared experts split, routed ones whole
    "attnres": (small_model("tiny_attnres"), "adamw"),
    "mhc": (small_model("tiny_mhc"), "adamw"),
    "engram": (small_model("tiny_engram", n_layers=4), "adamw"),
    "mtp": (small_model("tiny", **{"mtp.depth": 1}), "adamw"),
    "muon": (small_model("tiny"), "muon"),
}


def train_cases(rank: int, names: list[str], layout: dict) -> dict[str, dict]:
    """Every case of `names` trained on this rank, in one process group."""
    return {name: train(rank, CASES[name][0], layout, STEPS, optimizer_name=CASES[name][1])
            for name in names}  # fmt: skip


def assert_same_run(got: dict, ref: dict, name: str) -> None:
    for key, tensor in ref["initial"].items():
        assert torch.equal(got["initial"][key], tensor), f"{name}: initial {key} differs"
    torch.testing.assert_close(got["losses"], ref["losses"], rtol=RTOL, atol=ATOL, msg=name)
    torch.testing.assert_close(got["norms"], ref["norms"], rtol=1e-4, atol=1e-6, msg=name)
    for key, tensor in ref["final"].items():
        torch.testing.assert_close(
            got["final"][key],
            tensor,
            rtol=0,
            atol=WEIGHT_ATOL,
            msg=lambda m, k=key: f"{name} {k}: {m}",
        )
    assert ref["losses"][-1] < ref["losses"][0], name  # it did train


@pytest.mark.parametrize(
    ("ranks", "layout", "names"),
    [
        (2, {"tp": 2}, ["mla", "moe", "attnres", "mhc", "mtp", "muon"]),
        (4, {"tp": 2, "activation_checkpoint": "full"}, ["gdn", "kda"]),
    ],
    ids=["tp2", "dp_shard2_x_tp2_checkpointed"],
)
def test_every_family_trains_under_tensor_parallelism_as_one_process(ranks, layout, names):
    single = {name: train(0, CASES[name][0], {}, STEPS, optimizer_name=CASES[name][1])
              for name in names}  # fmt: skip
    results = run_ranks(ranks, train_cases, names, layout)
    for name in names:
        assert_same_run(results[0][name], single[name], name)
        for other in results[1:]:  # every rank logs the same values
            assert other[name]["losses"] == results[0][name]["losses"], name
    placements = results[0][names[0]]["placements"]
    tp_dim = "Shard(dim=0)" if ranks == 2 else "Shard(dim=0), Shard(dim=0)"
    assert any(tp_dim in p for p in placements.values())
