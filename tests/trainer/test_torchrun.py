"""`torchrun -m trainer` end to end on CPU (gloo): one run directory for the launch, rank 0 alone
writes `.hydra/`, `train.log` and `metrics.jsonl`, the other ranks log to `logs/rank<N>.log`; the
checkpoint of a 2-rank run resumes in one process and continues the loss curve."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.commands import OFFLINE, ROOT
from tests.trainer.helpers import SMALL_OVERRIDES, metric_rows, run_trainer, train_losses

pytestmark = [pytest.mark.integration, pytest.mark.distributed]


def torchrun(nproc: int, *overrides: str, cwd: Path, env: dict | None = None):
    import os
    import subprocess

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc_per_node={nproc}", "-m", "trainer", *overrides]
    full_env = (
        os.environ | OFFLINE | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"} | (env or {})
    )
    return subprocess.run(
        command, capture_output=True, text=True, cwd=cwd, env=full_env, timeout=600
    )


def test_two_ranks_on_a_fresh_machine_wait_for_rank_0_to_prepare_the_default_corpus(tmp_path):
    """No data.path and nothing prepared yet: rank 0 prepares the default corpus while rank 1
    waits for it (it used to stop at once, and torchrun ended the job)."""
    data = tmp_path / "data"
    run_dir = tmp_path / "run"
    small = [o for o in SMALL_OVERRIDES if not o.startswith("model.vocab_size=")]
    overrides = [*small, *FP32, "trainer.max_steps=1", f"hydra.run.dir={run_dir}"]
    result = torchrun(2, *overrides, cwd=tmp_path, env={"LMFORGE_DATA_DIR": str(data)})
    assert result.returncode == 0, result.stderr[-4000:]
    (prepared,) = data.iterdir()
    assert (prepared / "manifest.json").is_file()
    assert "preparing the default corpus" in (run_dir / "train.log").read_text()
    assert "done: 1 steps" in (run_dir / "train.log").read_text()


FP32 = ["trainer.precision=fp32", "trainer.eval_every=0"]


def test_two_ranks_share_one_run_directory_and_resume_in_one_process(dataset, tmp_path):
    common = [f"data.path={dataset}", *SMALL_OVERRIDES, *FP32, "trainer.max_steps=4"]
    result = torchrun(2, *common, "checkpoint.every=2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1, runs  # one directory per launch, not one per rank
    run_dir = runs[0]
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    log = (run_dir / "train.log").read_text()
    assert "world 2, dp_shard 2" in log
    assert "sample at step 4" in log  # sampling under FSDP: every rank runs the forwards
    assert (run_dir / "logs" / "rank1.log").is_file()
    two_ranks = train_losses(run_dir)
    assert sorted(two_ranks) == [1, 2, 3, 4]
    assert {"step_00000002", "step_00000004"} <= {
        p.name for p in (run_dir / "checkpoints").iterdir()
    }

    resumed_dir = tmp_path / "resumed"
    checkpoint = run_dir / "checkpoints" / "step_00000002"
    result = run_trainer(
        *common, f"resume={checkpoint}", f"hydra.run.dir={resumed_dir}", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-4000:]
    one_rank = train_losses(resumed_dir)
    assert sorted(one_rank) == [3, 4]  # continued at the step (and loader position) it saved
    for step in (3, 4):
        assert one_rank[step] == pytest.approx(two_ranks[step], rel=2e-5)


def test_a_moe_model_trains_with_expert_parallelism(dataset, tmp_path):
    run_dir = tmp_path / "moe"
    overrides = [f"data.path={dataset}", *SMALL_OVERRIDES, "model=tiny_moe"]
    overrides += ["model.moe.expert_hidden=32", "parallel.ep=2", "trainer.max_steps=3"]
    overrides += ["trainer.eval_every=0", f"hydra.run.dir={run_dir}"]
    result = torchrun(2, *overrides, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "ep 2 (expert weights sharded over 1)" in (run_dir / "train.log").read_text()
    rows = [r for r in metric_rows(run_dir) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    last = rows[-1]
    assert last["moe/imbalance"] >= 1.0 and last["moe/aux_loss"] > 0
    assert last["moe/layer1/bias_max"] > 0  # aux-loss-free balancing moved the biases
    assert (run_dir / "checkpoints" / "step_00000003" / ".metadata").is_file()
