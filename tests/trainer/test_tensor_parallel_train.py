"""`torchrun -m trainer parallel.tp=2` end to end on CPU (gloo, fp32): 2 ranks (tp=2) and 4 ranks
(dp_shard=2 x tp=2) train the loss curve of one process, and checkpoints move between tensor-
parallel sizes (tp=2 -> one process, one process -> dp_shard=2 x tp=2 with activation
checkpointing and sequence parallelism) and continue it exactly; what tensor parallelism does
not take yet is refused in one line, and trainer.compile=true is taken."""

from __future__ import annotations

from functools import partial

import pytest

from model.errors import ConfigError
from model.presets import load_preset
from tests.trainer.concurrent import concurrently
from tests.trainer.helpers import (
    SMALL_MODEL,
    SMALL_OVERRIDES,
    run_trainer,
    small_config,
    train_losses,
)
from tests.trainer.test_torchrun import torchrun
from trainer.build import check_start

pytestmark = [pytest.mark.integration, pytest.mark.distributed]

# MFU's peak given: no ~1 s matmul measurement at each start (test_mfu_peak.py tests it)
PEAK = "trainer.peak_flops=1e11"
FP32 = ["trainer.precision=fp32", "trainer.eval_every=0", "trainer.max_steps=4", PEAK]
# losses of the same fp32 steps: tp ranks sum partial products in another order (measured
# differences up to 2e-7 relative)
RTOL = 1e-5


def assert_same_losses(got: dict[int, float], want: dict[int, float], steps: list[int]) -> None:
    assert sorted(got) == steps
    for step in steps:
        assert got[step] == pytest.approx(want[step], rel=RTOL), step


def test_tensor_parallel_runs_equal_one_process_and_resume_across_tp_sizes(dataset, tmp_path):
    common = [f"data.path={dataset}", *SMALL_OVERRIDES, *FP32, "checkpoint.every=2"]
    one, tp2 = tmp_path / "one", tmp_path / "tp2"
    results = concurrently(  # independent runs
        partial(run_trainer, *common, f"hydra.run.dir={one}", cwd=tmp_path),
        partial(torchrun, 2, *common, "parallel.tp=2", f"hydra.run.dir={tp2}", cwd=tmp_path),
    )
    for result in results:
        assert result.returncode == 0, result.stderr[-4000:]
    whole = train_losses(one)

    log = (tp2 / "train.log").read_text()
    assert "world 2, dp_shard 1, tp 2" in log
    assert "sample at step 4" in log  # generation under tensor parallelism: every rank runs it
    assert_same_losses(train_losses(tp2), whole, [1, 2, 3, 4])

    # tp=2's checkpoint in one process, and one process's in dp_shard=2 x tp=2 (at once)
    to_one, to_dp2_tp2 = tmp_path / "tp2_to_one", tmp_path / "one_to_dp2_tp2"
    results = concurrently(
        partial(
            run_trainer,
            *common,
            f"resume={tp2 / 'checkpoints' / 'step_00000002'}",
            f"hydra.run.dir={to_one}",
            cwd=tmp_path,
        ),
        partial(
            torchrun,
            4,
            *common,
            "parallel.tp=2",
            "parallel.activation_checkpoint=full",  # recomputed blocks: the same numbers
            "parallel.sequence_parallel=true",  # the stream split along the sequence: the same
            f"resume={one / 'checkpoints' / 'step_00000002'}",
            f"hydra.run.dir={to_dp2_tp2}",
            cwd=tmp_path,
        ),
    )
    for result in results:
        assert result.returncode == 0, result.stderr[-4000:]
    assert_same_losses(train_losses(to_one), whole, [3, 4])
    assert "world 4, dp_shard 2, tp 2" in (to_dp2_tp2 / "train.log").read_text()
    assert_same_losses(train_losses(to_dp2_tp2), whole, [3, 4])


@pytest.mark.parametrize(
    ("settings", "world", "message"),
    [
        ({"parallel.tp": 3}, 4, "parallel.dp_replicate=1 x parallel.tp=3 = 3 does not divide"),
        # 4 query heads over 8 ranks: refused at start, before any process group or data
        ({"parallel.tp": 8}, 8, "parallel.tp=8 must divide the attention's 4 query heads"),
        (
            {"parallel.sequence_parallel": True, "data.seq_len": 30},
            8,
            "splits each window of data.seq_len=30 over parallel.tp=4 ranks; make data.seq_len",
        ),
    ],
)
def test_what_tensor_parallelism_does_not_take_is_refused_at_start(
    tmp_path, settings, world, message
):
    cfg = small_config(tmp_path)
    cfg.parallel.tp = world // 2 if world > 2 else 2
    for key, value in settings.items():
        group, name = key.split(".")
        setattr(getattr(cfg, group), name, value)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_start(cfg, world)


def test_compile_is_taken_under_tensor_parallelism(tmp_path):
    """(It was refused; tests/parallel/test_tensor_parallel_compile.py checks its gradients.)"""
    cfg = small_config(tmp_path)
    cfg.parallel.tp, cfg.trainer.compile = 2, "true"
    check_start(cfg, 2)


def test_qk_clip_is_taken_under_tensor_parallelism(tmp_path):
    """(It was refused; tests/parallel/test_tensor_parallel_qk_clip.py checks its numbers.)"""
    cfg = small_config(tmp_path)
    cfg.parallel.tp, cfg.optim.name, cfg.optim.qk_clip_tau = 2, "muonclip", 50.0
    check_start(cfg, 2)


def test_capacity_dropping_is_refused_with_sequence_parallelism(tmp_path):
    """Under sequence parallelism each tp rank routes its own positions through the experts:
    drops over a capacity would depend on the split."""
    cfg = small_config(tmp_path)
    cfg.model = load_preset("tiny_moe", SMALL_MODEL | {"moe.capacity_factor": 1.25})
    cfg.parallel.tp, cfg.parallel.sequence_parallel = 2, True
    with pytest.raises(ConfigError, match="model.moe.capacity_factor=1.25 with parallel.sequence"):
        check_start(cfg, 2)
    cfg.parallel.sequence_parallel = False  # every tp rank routes all tokens: the same drops
    check_start(cfg, 2)
