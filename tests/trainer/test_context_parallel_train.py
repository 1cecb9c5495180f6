"""`torchrun -m trainer parallel.cp=2` end to end on CPU (gloo, fp32): cp=2 trains the loss curve
of one process (packed documents crossing the ranks' chunks, a sample generated under the split,
validation whole), checkpoints move between context-parallel sizes (cp=2 -> one process, one
process -> a pipeline of 2 stages x cp=2 with activation checkpointing) and continue it exactly, a hybrid
Gated DeltaNet model on cp=2 x tp=2 with MuonClip trains one process's curve; what context
parallelism does not take is refused at start in one line."""

from __future__ import annotations

from functools import partial

import pytest

from model.errors import ConfigError
from model.presets import load_preset
from tests.trainer.concurrent import concurrently
from tests.trainer.helpers import SMALL_MODEL, SMALL_OVERRIDES, run_trainer, small_config
from tests.trainer.helpers import train_losses as losses_of
from tests.trainer.test_tensor_parallel_train import assert_same_losses
from tests.trainer.test_torchrun import torchrun
from trainer.build import check_start

pytestmark = [pytest.mark.integration, pytest.mark.distributed]

# MFU's peak given: no ~1 s matmul measurement at each start (test_mfu_peak.py tests it)
PEAK = "trainer.peak_flops=1e11"
FP32 = ["trainer.precision=fp32", "trainer.max_steps=4", "trainer.doc_mask=true", PEAK]


def test_context_parallel_runs_equal_one_process_and_resume_across_cp_sizes(dataset, tmp_path):
    common = [f"data.path={dataset}", *SMALL_OVERRIDES, *FP32, "checkpoint.every=2"]
    common += ["trainer.eval_every=2"]  # validation forwards split over the cp ranks too
    one, cp2 = tmp_path / "one", tmp_path / "cp2"
    results = concurrently(  # independent runs
        partial(run_trainer, *common, f"hydra.run.dir={one}", cwd=tmp_path),
        partial(torchrun, 2, *common, "parallel.cp=2", f"hydra.run.dir={cp2}", cwd=tmp_path),
    )
    for result in results:
        assert result.returncode == 0, result.stderr[-4000:]
    whole = losses_of(one)

    log = (cp2 / "train.log").read_text()
    assert "world 2, dp_shard 1, cp 2" in log
    assert "each rank computes 2 of the 4 head-tail chunks of every training sequence" in log
    assert "sample at step 4" in log  # generation: every cp rank runs the whole sequence
    assert_same_losses(losses_of(cp2), whole, [1, 2, 3, 4])
    assert validation_losses(cp2) == pytest.approx(validation_losses(one), rel=1e-5)

    # cp=2's checkpoint in one process, and one process's in a pipeline of 2 stages, each split
    # over cp=2 (the pipeline's own schedule runs the step's 2 micro-batches; validation passes
    # the stages in order): independent runs, at once
    to_one, resumed = tmp_path / "cp2_to_one", tmp_path / "one_to_pp2_cp2"
    results = concurrently(
        partial(
            run_trainer,
            *common,
            f"resume={cp2 / 'checkpoints' / 'step_00000002'}",
            f"hydra.run.dir={to_one}",
            cwd=tmp_path,
        ),
        partial(
            torchrun,
            4,
            *common,
            "parallel.cp=2",
            "parallel.pp=2",
            "parallel.activation_checkpoint=full",  # recomputed blocks: the same numbers
            f"resume={one / 'checkpoints' / 'step_00000002'}",
            f"hydra.run.dir={resumed}",
            cwd=tmp_path,
        ),
    )
    for result in results:
        assert result.returncode == 0, result.stderr[-4000:]
    assert_same_losses(losses_of(to_one), whole, [3, 4])

    log = (resumed / "train.log").read_text()
    assert "world 4, pp 2, dp_shard 1, cp 2" in log
    assert "pipeline: 1F1B, 2 stages on 2 ranks" in log
    assert "rank 1: stage 1: layer 1, head + loss" in log
    assert "sample at step 4" in log  # generation through the stages
    assert_same_losses(losses_of(resumed), whole, [3, 4])
    assert validation_losses(resumed)[-1] == pytest.approx(validation_losses(one)[-1], rel=1e-5)


def validation_losses(run_dir) -> list[float]:
    from tests.trainer.helpers import metric_rows

    return [r["val_loss"] for r in metric_rows(run_dir) if "val_loss" in r]


def test_a_hybrid_model_on_context_and_tensor_parallel_ranks_equals_one_process(dataset, tmp_path):
    """Gated DeltaNet layers (state passing over the cp ranks, conv halos) between softmax
    attention, split over cp=2 x tp=2 (heads over tp, positions over cp), with MuonClip
    (each matrix orthogonalized whole once, QK-clip's max logits over every rank's keys)."""
    hybrid = ["model=tiny_hybrid", *SMALL_OVERRIDES, "model.layer_pattern=[gdn,gqa]"]
    hybrid += ["model.gdn.head_dim=16", "model.gdn.v_head_dim=16", "optim.name=muonclip"]
    common = [f"data.path={dataset}", *hybrid, *FP32, "trainer.eval_every=0"]
    one, split = tmp_path / "one", tmp_path / "cp2_tp2"
    results = concurrently(  # independent runs
        partial(run_trainer, *common, f"hydra.run.dir={one}", cwd=tmp_path),
        partial(
            torchrun,
            4,
            *common,
            "parallel.cp=2",
            "parallel.tp=2",
            f"hydra.run.dir={split}",
            cwd=tmp_path,
        ),
    )
    for result in results:
        assert result.returncode == 0, result.stderr[-4000:]
    assert "world 4, dp_shard 1, cp 2, tp 2" in (split / "train.log").read_text()
    assert_same_losses(losses_of(split), losses_of(one), [1, 2, 3, 4])


SEQ_36 = {"data.seq_len": 36}


@pytest.mark.parametrize(
    ("settings", "world", "message"),
    [
        ({"parallel.cp": 3}, 4, "parallel.dp_replicate=1 x parallel.cp=3 = 3 does not divide"),
        (
            {"parallel.cp": 4} | SEQ_36,
            4,
            "parallel.cp=4 splits each window of data.seq_len=36 into 2 x cp = 8 chunks; make",
        ),
        (
            {"parallel.cp": 2, "parallel.tp": 4, "parallel.sequence_parallel": True} | SEQ_36,
            8,
            "with parallel.sequence_parallel=true splits each rank's 18 positions over "
            "parallel.tp=4; make data.seq_len a multiple of 8",
        ),
        (
            {"parallel.cp": 2, "parallel.engine": "deepspeed"},
            2,
            "parallel.cp=2 runs on parallel.engine=fsdp2",
        ),
        (
            {"parallel.cp": 2, "model.position": "alibi"},
            2,
            "context parallelism does not split alibi positions yet; use model.position=rope",
        ),
    ],
)
def test_what_context_parallelism_does_not_take_is_refused_at_start(
    tmp_path, settings, world, message
):
    cfg = small_config(tmp_path)
    for key, value in settings.items():
        group, name = key.split(".")
        setattr(getattr(cfg, group), name, value)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_start(cfg, world)


def test_capacity_dropping_is_refused_with_context_parallelism(tmp_path):
    cfg = small_config(tmp_path)
    cfg.model = load_preset("tiny_moe", SMALL_MODEL | {"moe.capacity_factor": 1.25})
    cfg.parallel.cp = 2
    with pytest.raises(ConfigError, match="model.moe.capacity_factor=1.25 with parallel.cp > 1"):
        check_start(cfg, 2)


@pytest.mark.parametrize(
    ("settings", "world", "message"),
    [
        ({"parallel.pp": 3}, 4, "parallel.pp=3 x parallel.dp_replicate=1 = 3 does not divide"),
        (
            {"parallel.pp": 2, "parallel.engine": "deepspeed"},
            2,
            "parallel.pp=2 runs on parallel.engine=fsdp2",
        ),
        (
            {"parallel.pp": 2, "parallel.pp_schedule": "ZBVZeroBubble", "model.mtp.depth": 1},
            2,
            "parallel.pp_schedule=ZBVZeroBubble splits the backward into input and weight",
        ),
        (
            {"parallel.pp": 2, "parallel.pp_microbatches": 3},
            2,
            r"4 sequences per data-parallel rank \(trainer.batch_size=4\) do not split into 3",
        ),
        (
            {"parallel.pp": 2, "parallel.pp_layers": [1, 2]},
            2,
            r"parallel.pp_layers=\[1, 2\] must list the layers of each of the 2 stages",
        ),
    ],
)
def test_what_pipeline_parallelism_does_not_take_is_refused_at_start(
    tmp_path, settings, world, message
):
    cfg = small_config(tmp_path)
    for key, value in settings.items():
        *path, name = key.split(".")
        target = cfg
        for part in path:
            target = getattr(target, part)
        setattr(target, name, value)
    with pytest.raises(ConfigError, match=message):
        check_start(cfg, world)
