"""Pipeline parallelism (parallel/pipeline.py) on gloo ranks against one process, fp32: every
schedule of torch.distributed.pipelining (pp=2; the interleaved and V ones with two stages per
rank) and every family (MoE with its balance terms on both stages, MLA, Gated DeltaNet, mHC,
Attention Residuals Full and Block, Engram, MTP with its shared embedding on the last stage,
MuonClip with QK-clip) give one process's losses, gradient norms and final weights (AdamW: each
step moves a weight by at most lr, so the weights compare to a fraction of that; the losses and
norms, which show a wrong gradient at once, compare tightly); composed with data, tensor, context
and expert parallelism and activation checkpointing on 4 ranks (pp=4 interleaved and V too);
validation and scoring forwards, generation, init_from weights read per stage, a skipped step;
and a run resumed with another pipeline size or schedule."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model.transformer import build_model
from tests.parallel.pp_workers import (
    CASES,
    MB,
    STEPS,
    bf16_losses,
    evaluation,
    generated,
    run_case,
    run_cases,
    skipped_step,
)
from tests.parallel.ranks import run_ranks
from tests.parallel.workers import started_from_counted_reads, train

pytestmark = pytest.mark.distributed
RTOL, ATOL = 2e-5, 2e-6
# AdamW turns rounding in a gradient near 0 into up to lr per step (3e-3); Muon's
# Newton-Schulz on sharded matrices rounds likewise (tests/parallel/test_muon_fsdp.py)
WEIGHT_ATOL = 0.05 * STEPS * 3e-3

TWO_RANKS = [
    ("tiny", {"pp": 2}),
    ("tiny", {"pp": 2, "pp_schedule": "GPipe"}),
    ("attnres", {"pp": 2, "pp_schedule": "Interleaved1F1B"}),  # tied embedding on ranks 0, 1
    ("untied", {"pp": 2, "pp_schedule": "LoopedBFS"}),
    ("moe_untied", {"pp": 2, "pp_schedule": "InterleavedZeroBubble"}),
    ("attnres_untied", {"pp": 2, "pp_schedule": "ZBVZeroBubble"}),  # inputs passed on, split
    ("tiny", {"pp": 2, "pp_schedule": "DualPipeV"}),  # the last stage's embedding copy
    ("moe", {"pp": 2}),
    ("mla", {"pp": 2}),
    ("gdn", {"pp": 2}),
    ("mhc", {"pp": 2}),
    ("attnres_block", {"pp": 2}),
    ("engram", {"pp": 2}),
    ("mtp", {"pp": 2, "pp_schedule": "Interleaved1F1B"}),
    ("muonclip", {"pp": 2}),
]
FOUR_RANKS = [
    ("tiny", {"pp": 2}),  # x dp_shard 2
    ("untied", {"pp": 2, "dp_replicate": 2}),  # HSDP per stage (replicas of 1 shard)
    ("mla", {"pp": 2, "tp": 2}),
    ("gdn", {"pp": 2, "cp": 2}),
    ("moe_exact", {"pp": 2, "ep": 2}),  # x dp_shard 2 = ep 2
    ("attnres_block", {"pp": 2, "activation_checkpoint": "full"}),
    ("tiny8", {"pp": 4, "pp_schedule": "Interleaved1F1B"}),
    ("tiny8", {"pp": 4, "pp_schedule": "ZBVZeroBubble"}),
]


def reference(name: str) -> dict:
    return run_case(0, name, {})


def assert_same_run(got: dict, ref: dict, name: str, label: str) -> None:
    for key, tensor in got["initial"].items():  # each rank holds its stages' weights
        assert torch.equal(tensor, ref["initial"][key]), f"{label}: initial {key} differs"
    torch.testing.assert_close(got["losses"], ref["losses"], rtol=RTOL, atol=ATOL, msg=label)
    torch.testing.assert_close(got["norms"], ref["norms"], rtol=1e-4, atol=1e-6, msg=label)
    persistent = build_model(CASES[name][0], device="meta").state_dict().keys()
    for key, tensor in got["final"].items():
        if key in persistent:  # (not statistics of the last forward's tokens)
            torch.testing.assert_close(
                tensor, ref["final"][key], rtol=0, atol=WEIGHT_ATOL, msg=f"{label} {key}"
            )
    moved = [k for k, t in got["final"].items() if not torch.equal(t, got["initial"][k])]
    assert moved, f"{label}: no weight was updated"  # (the comparison above is not vacuous)


def assert_whole_model(results: list[dict], name: str) -> None:
    """The ranks together hold every weight of the model once per data-parallel copy."""
    whole = build_model(CASES[name][0], device="meta")
    names = {n for n, _ in whole.named_parameters()} | {n for n, _ in whole.named_buffers()}
    held = set().union(*(r["final"] for r in results))
    assert held == names, name


def test_every_schedule_and_family_trains_on_two_stages_as_one_process():
    results = run_ranks(2, run_cases, TWO_RANKS)
    refs: dict[str, dict] = {}
    for index, (name, layout) in enumerate(TWO_RANKS):
        ref = refs.setdefault(name, reference(name))
        label = f"{name} {layout}"
        for rank in (0, 1):
            assert_same_run(results[rank][index], ref, name, label)
        assert results[0][index]["losses"] == results[1][index]["losses"], label
        assert_whole_model([results[0][index], results[1][index]], name)
        stats = results[0][index]["stats"][-1]
        if name.startswith("moe"):  # every stage's MoE layers in rank 0's row
            assert {"moe/layer1/imbalance", "moe/layer3/imbalance"} <= stats.keys(), stats
            torch.testing.assert_close(
                stats["moe/aux_loss"], ref["stats"][-1]["moe/aux_loss"], rtol=1e-4, atol=1e-7
            )
        if name == "muonclip":
            assert stats["qk/max_logit"] == pytest.approx(ref["stats"][-1]["qk/max_logit"], 1e-5)
        if name == "mtp":
            assert stats["mtp/loss_1"] == pytest.approx(ref["stats"][-1]["mtp/loss_1"], 1e-5)


def test_pipeline_composes_with_data_tensor_context_expert_parallelism_on_four_ranks():
    """(moe_exact: the Switch balance loss is per data rank's tokens, as without a pipeline, so
    the exact comparison leaves it out; the sequence-wise one and z-loss stay on.)"""
    results = run_ranks(4, run_cases, FOUR_RANKS)
    for index, (name, layout) in enumerate(FOUR_RANKS):
        ref = reference(name)
        for rank in range(4):
            assert_same_run(results[rank][index], ref, name, f"{name} {layout}")
        assert_whole_model([r[index] for r in results], name)


def evaluation_and_generation(rank: int) -> dict:
    layout = {"pp": 2, "pp_schedule": "Interleaved1F1B"}
    return {
        "evaluation": evaluation(rank, "moe_untied", layout),
        "attnres": generated(rank, "attnres", layout),  # its sources cross the stages
        "mhc": generated(rank, "mhc", {"pp": 2}),
        "init_from": started_from_counted_reads(rank, CASES["untied"][0], {"pp": 2}),
        "skipped": skipped_step(rank, {"pp": 2}),
        # bf16: mHC's n streams cross the stages in fp32 (its connections compute in fp32)
        "bf16": {name: bf16_losses(rank, name, {"pp": 2}) for name in ("mhc", "attnres")},
    }


def test_validation_scoring_generation_and_skipped_steps_cover_every_stage():
    got = run_ranks(2, evaluation_and_generation)
    whole = evaluation(0, "moe_untied", {})
    for rank in (0, 1):
        result = got[rank]["evaluation"]
        torch.testing.assert_close(result["loss"], whole["loss"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(result["log_probs"], whole["log_probs"], rtol=1e-5, atol=1e-6)
    for name in ("attnres", "mhc"):
        one = generated(0, name, {})
        for rank in (0, 1):  # the same tokens on every rank, as one process draws them
            assert torch.equal(got[rank][name]["greedy"], one["greedy"]), name
            assert torch.equal(got[rank][name]["sampled"], one["sampled"]), name
    # init_from's whole weights: each stage reads only the tensors it holds, and gets them
    weights = build_model(CASES["untied"][0], device="cpu", seed=7).state_dict()
    for rank in (0, 1):
        loaded, reads, held = got[rank]["init_from"]
        assert set(reads) == set(held) != set(weights), rank
        for name, tensor in loaded.items():
            assert torch.equal(tensor, weights[name]), name
    for name in ("mhc", "attnres"):  # bf16 rounding apart, one process's losses
        one = bf16_losses(0, name, {})
        for rank in (0, 1):
            torch.testing.assert_close(got[rank]["bf16"][name], one, rtol=1e-2, atol=0, msg=name)
    for rank in (0, 1):  # a NaN gradient on the last stage's rank stops every rank's update
        skipped = got[rank]["skipped"]
        assert skipped["norm"] != skipped["norm"] and not skipped["applied"], rank
        assert skipped["unchanged"], rank


def resumed(rank: int, root: str) -> dict:
    """Two steps of a tied-head model on pp=2 (1F1B: both ranks hold embed.weight), saved; then
    the third step resumed on dp_shard=2 without a pipeline, and on pp=2 under ZBVZeroBubble
    (4 stages in a V: rank 0's last stage keeps its own copy of the embedding)."""
    cfg, _, _ = CASES["tiny"]
    train(rank, cfg, {"pp": 2}, 2, MB, save_to=f"{root}/pp")
    (saved,) = (str(path) for path in Path(root, "pp").glob("step_*"))
    plain = train(rank, cfg, {}, 1, MB, resume_from=saved)
    v_shape = train(rank, cfg, {"pp": 2, "pp_schedule": "ZBVZeroBubble"}, 1, MB, resume_from=saved)  # fmt: skip
    return {"plain": plain, "v": v_shape}


def test_a_pipeline_run_resumes_with_another_pipeline_size_and_schedule(tmp_path: Path):
    whole = reference("tiny")
    got = run_ranks(2, resumed, str(tmp_path))
    for rank in (0, 1):
        for kind in ("plain", "v"):
            run = got[rank][kind]
            label = f"resumed {kind}"
            torch.testing.assert_close(run["losses"], whole["losses"][2:], rtol=RTOL, atol=ATOL, msg=label)  # fmt: skip
            torch.testing.assert_close(run["norms"], whole["norms"][2:], rtol=1e-4, atol=1e-6, msg=label)  # fmt: skip
            for key, tensor in run["final"].items():
                torch.testing.assert_close(tensor, whole["final"][key], rtol=0, atol=WEIGHT_ATOL, msg=f"{label} {key}")  # fmt: skip
