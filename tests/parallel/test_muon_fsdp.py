"""Muon with FSDP2 (gloo): each matrix orthogonalized whole on one rank and scattered back gives
the single-process result; its state reshards through DCP like AdamW's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.parallel.ranks import run_ranks
from tests.parallel.workers import sharded_newton_schulz, small_model, train

pytestmark = pytest.mark.distributed
STEPS = 3


# one wave; waves of one round; waves of two rounds (the largest padded matrix: 32 x 96)
@pytest.mark.parametrize("batch_elements", [None, 4096, 8192])
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_newton_schulz_is_bitwise_and_done_once(
    world: int, batch_elements: int | None
) -> None:
    # uneven shards (7 rows over 2 or 4 ranks), tall and wide, expert stacks, a fused weight;
    # repeated shapes are batched (4096 elements: (64, 32) pairs, the rest alone)
    shapes = [(64, 32), (7, 48), (32, 96), (4, 16, 24), (5, 8), (64, 32), (7, 48), (4, 16, 24)]
    per_rank = run_ranks(world, sharded_newton_schulz, shapes, batch_elements)
    for result in per_rank:
        assert all(result["equal"]), result["equal"]
        assert result["work"].get("fallback", 0) == 0, result["work"]
    # owner-path matrices: 6 FSDP 2-D + the fused one + the 8 experts split inside (dim 1) + 6
    # replicated 2-D; with 4 ranks also 6 HSDP 2-D, 2 stacks x 2 ep groups x 2 experts, 8 HSDP
    # experts
    owned = [result["work"].get("owned", 0) for result in per_rank]
    assert sum(owned) == 21 + (22 if world == 4 else 0)  # each orthogonalized once in the job
    assert max(owned) - min(owned) <= 1, owned  # and the work is dealt out evenly


@pytest.fixture(scope="module")
def single() -> dict:
    return train(0, small_model(), {}, STEPS, 1, "fp32", 1.0, "", "", "muon")


@pytest.mark.parametrize(("world", "layout"), [(2, {}), (4, {"dp_replicate": 2})])
def test_sharded_muon_equals_one_process(single: dict, world: int, layout: dict) -> None:
    results = run_ranks(world, train, small_model(), layout, STEPS, 1, "fp32", 1.0, "", "", "muon")
    # The sharded Newton-Schulz itself is bitwise (test above); what differs is the fp32
    # gradient reduction order, which can flip bf16 roundings inside Newton-Schulz: an update
    # element then moves by a bf16 step (~0.4%) of lr x scale x |O| (~1e-3 here) per step.
    torch.testing.assert_close(results[0]["losses"], single["losses"], rtol=1e-5, atol=1e-5)
    for name, tensor in single["final"].items():
        torch.testing.assert_close(results[0]["final"][name], tensor, rtol=0, atol=5e-4, msg=name)
    assert single["losses"][-1] < single["losses"][0]


@pytest.mark.parametrize("experts", [2, 8])
def test_muon_with_expert_parallelism_equals_one_process_without_fallback(experts: int) -> None:
    # ep=2 x FSDP=2: 8 experts leave 4 local experts, FSDP splits them along E (a strided
    # shard; orthogonalized locally); 2 experts leave 1, which FSDP splits on dim 1 (each expert
    # matrix is gathered onto an owner rank)
    moe = small_model("tiny_moe", **{"moe.expert_hidden": 32, "moe.n_routed_experts": experts})
    single = train(0, moe, {}, STEPS, 1, "fp32", 1.0, "", "", "muon")
    results = run_ranks(4, train, moe, {"ep": 2}, STEPS, 1, "fp32", 1.0, "", "", "muon")
    expert_placement = results[0]["placements"]["layers.1.ffn.experts.w_gate"]
    assert ("Shard(dim=1)" in expert_placement) == (experts == 2), expert_placement
    for result in results:
        assert result["newton_schulz"].get("fallback", 0) == 0, result["newton_schulz"]
        # 5e-5: with 8 experts the EP run's reduction order moves even AdamW's losses by 2e-5
        torch.testing.assert_close(result["losses"], single["losses"], rtol=5e-5, atol=1e-5)


def test_muon_state_survives_a_resharding_resume(tmp_path: Path, single: dict) -> None:
    first = run_ranks(2, train, small_model(), {}, 2, 1, "fp32", 1.0, "", str(tmp_path), "muon")[0]
    second = train(
        0, small_model(), {}, 1, 1, "fp32", 1.0, str(tmp_path / "step_00000002"), "", "muon"
    )
    torch.testing.assert_close(
        first["losses"] + second["losses"], single["losses"], rtol=1e-4, atol=1e-5
    )


def test_muonclip_under_fsdp_clips_like_one_process() -> None:
    # tau below the initial logits: heads are clipped from the first step on
    args = (small_model(), {}, STEPS, 1, "fp32", 1.0, "", "", "muonclip", 0.02)
    single = train(0, *args)
    sharded = run_ranks(2, train, *args)[0]
    assert single["stats"][0]["qk/clipped_heads"] > 0
    # step 1 sees the same weights (to fp32 order); later steps differ by Muon's bf16 roundings
    first, first_ref = sharded["stats"][0], single["stats"][0]
    assert first["qk/max_logit"] == pytest.approx(first_ref["qk/max_logit"], rel=1e-5)
    for got, want in zip(sharded["stats"], single["stats"]):
        assert got["qk/clipped_heads"] == want["qk/clipped_heads"]
        assert got["qk/max_logit"] == pytest.approx(want["qk/max_logit"], rel=2e-3)
    torch.testing.assert_close(sharded["losses"], single["losses"], rtol=1e-5, atol=1e-5)
