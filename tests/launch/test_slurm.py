"""On a real single-node SLURM (launch/slurm/local_cluster.sh; CI installs the Debian packages):
launch/slurm/train.sbatch with 2 CPU ranks trains and finishes; a job signalled as at its
pre-timeout (SIGUSR2 to the batch shell) checkpoints, requeues itself, resumes with
SLURM_RESTART_COUNT=1 and ends with the uninterrupted job's losses; Hydra's submitit launcher
submits a sweep."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.commands import OFFLINE, ROOT
from tests.trainer.helpers import SMALL_OVERRIDES, train_losses

pytestmark = [pytest.mark.slurm, pytest.mark.integration, pytest.mark.distributed]
CLUSTER = ROOT / "launch" / "slurm" / "local_cluster.sh"
TEMPLATE = ROOT / "launch" / "slurm" / "train.sbatch"
# MFU's peak given: no ~1 s matmul measurement at each start (test_mfu_peak.py tests it)
PEAK = "trainer.peak_flops=1e11"
OVERRIDES = [*SMALL_OVERRIDES, "trainer.precision=fp32", "trainer.eval_every=0", PEAK]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    """A single-node SLURM started here; LMFORGE_SLURM_CLUSTER=existing submits to the one that
    `sinfo` reaches instead (its nodes must see this machine's /tmp)."""
    if os.environ.get("LMFORGE_SLURM_CLUSTER") == "existing":
        yield {}
        return
    if _cluster_answers():
        pytest.skip("a SLURM cluster already answers: set LMFORGE_SLURM_CLUSTER=existing to use it")
    missing = [c for c in ("slurmctld", "slurmd", "munged", "sbatch") if not _which(c)]
    if missing or os.geteuid() != 0:
        reason = f"needs root and SLURM ({', '.join(missing) or 'not root'}): .ci/run installs it"
        if os.environ.get("LMFORGE_REQUIRE_SLURM") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    state = tmp_path_factory.mktemp("slurm")
    start = subprocess.run(
        ["bash", str(CLUSTER), "start", str(state)], capture_output=True, text=True, timeout=180
    )
    assert start.returncode == 0, start.stdout + start.stderr
    try:
        yield {"SLURM_CONF": str(state / "slurm.conf")}
    finally:
        subprocess.run(["bash", str(CLUSTER), "stop", str(state)], timeout=120, check=False)


def _cluster_answers() -> bool:
    if not _which("sinfo"):
        return False
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=15).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _which(command: str) -> str | None:
    return shutil.which(command, path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")


def job_env(cluster: dict) -> dict[str, str]:
    return (
        os.environ
        | OFFLINE
        | cluster
        | {
            "PYTHONPATH": str(ROOT),
            "PYTHON": sys.executable,
            "NPROC_PER_NODE": "2",
            "OMP_NUM_THREADS": "1",
        }
    )


def submit(
    cluster: dict, cwd: Path, name: str, *overrides: str, layout: tuple[str, ...] = ()
) -> subprocess.Popen:
    """`sbatch --wait` of a template in the background (it returns when the job has ended for
    good, requeues included, with the job's exit code)."""
    command = ["sbatch", "--wait", "--parsable", f"--job-name={name}", "--nodes=1"]
    command += list(layout or ("--cpus-per-task=2", str(TEMPLATE)))
    command += [*OVERRIDES, *overrides]
    return subprocess.Popen(
        command,
        cwd=cwd,
        env=job_env(cluster),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def unique(name: str) -> str:
    return f"lmforge-{name}-{uuid.uuid4().hex[:8]}"


def cancel(name: str, cluster: dict) -> None:
    subprocess.run(["scancel", "-n", name], env=os.environ | cluster, check=False)


def job_id(name: str, cluster: dict, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(
            ["squeue", "-h", "-n", name, "-o", "%i"],
            capture_output=True,
            text=True,
            env=os.environ | cluster,
        )
        if out.stdout.strip():
            return out.stdout.split()[0]
        time.sleep(0.5)
    raise AssertionError(f"job {name} never appeared in squeue")


def finish(job: subprocess.Popen, timeout: float = 600) -> None:
    out, err = job.communicate(timeout=timeout)
    assert job.returncode == 0, out + err


def wait_for_step(run_dir: Path, step: int, timeout: float = 300) -> None:
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                try:  # the last line may be half written
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if row.get("step", 0) >= step and "loss" in row:
                    return
        time.sleep(0.2)
    raise AssertionError(f"{metrics} did not reach step {step}")


def test_a_job_trains_is_preempted_requeues_itself_and_ends_like_an_uninterrupted_one(
    cluster: dict, dataset: Path, tmp_path: Path
) -> None:
    # 200 steps: the signal sent at step 3 must land well before the end (tens of ms a step)
    steps = [f"data.path={dataset}", "trainer.max_steps=200", "checkpoint.every=1000"]
    steps += ["trainer.log_every=1", "trainer.compile=false"]
    # the two jobs at once, one CPU each (the node has 2): the uninterrupted job trains while
    # the other waits to be requeued
    layout = ("--cpus-per-task=1", str(TEMPLATE))
    plain_name, preempted_name = unique("plain"), unique("preempted")
    try:
        plain = submit(cluster, tmp_path, plain_name, *steps, layout=layout)
        job = submit(cluster, tmp_path, preempted_name, *steps, layout=layout)
        plain_id = job_id(plain_name, cluster)
        preempted_id = job_id(preempted_name, cluster)
        run_dir = tmp_path / "runs" / f"slurm-{preempted_id}"
        wait_for_step(run_dir, 3)
        # what --signal=B:USR2@120 does before the time limit: SIGUSR2 to the batch shell
        subprocess.run(
            ["scancel", "--signal=USR2", "--batch", preempted_id],
            check=True,
            env=os.environ | cluster,
        )
        finish(plain)
        finish(job)
    finally:
        for name in (plain_name, preempted_name):
            cancel(name, cluster)
    plain_dir = tmp_path / "runs" / f"slurm-{plain_id}"
    assert "world 2" in (plain_dir / "train.log").read_text()
    uninterrupted = train_losses(plain_dir)
    assert sorted(uninterrupted) == list(range(1, 201))
    log = (run_dir / "train.log").read_text()
    assert "SIGUSR2 received" in log and f"job {preempted_id} requeued" in log
    assert f"SLURM job {preempted_id} (restart count 1)" in log and "resumed from" in log
    output = (tmp_path / f"slurm-{preempted_id}.out").read_text()  # --open-mode=append
    assert "(restart 0)" in output and "(restart 1)" in output
    assert train_losses(run_dir) == uninterrupted  # the resumed steps recomputed bitwise


def test_hydra_submitit_launcher_submits_a_sweep(
    cluster: dict, dataset: Path, tmp_path: Path
) -> None:
    sweep = tmp_path / "sweep"
    command = [sys.executable, "-m", "trainer", "-m", "hydra/launcher=lmforge_slurm"]
    command += [f"hydra.sweep.dir={sweep}", "hydra.launcher.cpus_per_task=1"]
    command += [f"data.path={dataset}", *OVERRIDES, "trainer.max_steps=2", "optim.lr=1e-3,2e-3"]
    env = job_env(cluster) | {"NPROC_PER_NODE": "1"}
    result = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for point in ("0", "1"):
        assert sorted(train_losses(sweep / point)) == [1, 2]


def test_one_task_per_rank_without_torchrun_maps_the_slurm_variables(
    cluster: dict, dataset: Path, tmp_path: Path
) -> None:
    template = str(TEMPLATE.with_name("train_srun.sbatch"))
    layout = ("--ntasks-per-node=2", "--cpus-per-task=1", template)
    name = unique("srun")
    try:
        job = submit(
            cluster, tmp_path, name, f"data.path={dataset}", "trainer.max_steps=3", layout=layout
        )
        number = job_id(name, cluster)
        finish(job)
    finally:
        cancel(name, cluster)
    run_dir = tmp_path / "runs" / f"slurm-{number}"
    assert "world 2" in (run_dir / "train.log").read_text()
    assert (run_dir / "logs" / "rank1.log").is_file()  # RANK came from SLURM_PROCID
    assert sorted(train_losses(run_dir)) == [1, 2, 3]
