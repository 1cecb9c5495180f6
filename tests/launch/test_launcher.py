"""`python -m launch.torchrun`: the command it builds, its checks before anything starts, and for
real on CPU (gloo): an elastic restart after a worker dies continues to the uninterrupted run's
losses, and two "nodes" (two launchers on localhost, c10d rendezvous) train together."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.commands import OFFLINE, ROOT, run_module
from tests.trainer.helpers import SMALL_OVERRIDES, train_losses


def launch(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_module("launch.torchrun", *args, cwd=cwd, env={"OMP_NUM_THREADS": "1"} | (env or {}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_printed_command_is_standalone_or_c10d(tmp_path: Path) -> None:
    one = launch("--dry-run", "--nproc-per-node=2", "--max-restarts=3", "model=tiny", cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    assert "--standalone" in one.stdout and "--max-restarts=3" in one.stdout
    assert "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2" in one.stdout
    assert one.stdout.rstrip().endswith("-m trainer model=tiny")
    args = ["--dry-run", "--nnodes=2", "--node-rank=1", "--master-addr=host0"]
    two = launch(*args, "--master-port=29400", "--rdzv-id=job7", cwd=tmp_path)
    assert two.returncode == 0, two.stderr
    for part in ("--rdzv-endpoint=host0:29400", "--rdzv-id=job7", "--rdzv-conf=is_host=0"):
        assert part in two.stdout


def test_bad_launches_are_refused_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from launch.torchrun import main

    job = {"SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "0"}
    step = job | {"SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "1"}
    refusals = [
        (["--nnodes=2"], step, "--nnodes=2 but this srun step runs on 1 node(s)"),
        ([], step | {"SLURM_STEP_NUM_TASKS": "8"}, "runs 8 tasks on 1 node(s)"),
        (["--nnodes=2"], job, "outside an srun step: run the launcher with srun"),
        (["--nnodes=2"], {}, "needs the rendezvous address"),
        (["--nnodes=2", "--master-addr=h", "--master-port=1"], {}, "needs --rdzv-id"),
    ]
    for args, env, message in refusals:  # in this process (each command costs ~4 s to start)
        with monkeypatch.context() as patch:
            for name in [n for n in os.environ if n.startswith(("SLURM_", "MASTER_"))]:
                patch.delenv(name)
            for name, value in env.items():
                patch.setenv(name, value)
            patch.chdir(tmp_path)
            code = main(["--dry-run", *args])
        stderr = capsys.readouterr().err
        assert code == 2 and message in stderr, (args, stderr)
    # the command itself refuses too (one line, exit status 2)
    result = launch("--dry-run", *refusals[0][0], cwd=tmp_path, env=refusals[0][1])
    assert result.returncode == 2 and refusals[0][2] in result.stderr, result.stderr
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = [
            "--dry-run",
            "--nnodes=2",
            "--node-rank=0",
            "--master-addr=127.0.0.1",
            "--rdzv-id=x",
        ]
        result = launch(*args, f"--master-port={port}", cwd=tmp_path)
    assert result.returncode == 2 and f"rendezvous port {port}" in result.stderr
    assert "is in use" in result.stderr
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    result = launch("--dry-run", f"hydra.run.dir={blocker}/run", cwd=tmp_path)
    assert result.returncode == 2 and "cannot be created" in result.stderr


def test_a_settings_error_is_one_line_before_any_worker_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Issue 52: the launcher composes the trainer's settings once; an unknown key is one line
    (exit 2), not a message per rank plus torchrun's ChildFailedError traceback."""
    from launch.torchrun import main

    monkeypatch.chdir(tmp_path)
    code = main(["--dry-run", "--nproc-per-node=2", "--", "trainer.nonsense=1"])  # this process
    out = capsys.readouterr()
    assert code == 2 and not out.out, out
    assert out.err.splitlines() == [
        "error: trainer.nonsense is not a setting (TrainerConfig has no field 'nonsense'): check "
        "its spelling; `python -m trainer --cfg job` lists every setting with its default"
    ]
    result = launch("--nproc-per-node=2", "trainer.batch_size=abc", cwd=tmp_path)  # for real
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and result.stdout == "", result.stderr[-3000:]  # no torchrun
    assert len(lines) == 1 and "trainer.batch_size=abc" in lines[0], result.stderr[-3000:]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("launch_args", "message"),
    [
        (["--nproc-per-node=16"], "trainer.batch_size=8 is not divisible by the 16 data-parallel"),
        (["--nproc-per-node=2", "--nnodes=2", "--node-rank=0", "--master-addr=localhost",
          "--master-port=29511", "--rdzv-id=x", "--", "parallel.ep=3", "trainer.batch_size=12",
          "model=tiny_moe"], "parallel.ep=3"),
    ],
    ids=["batch_over_ranks", "experts_over_ranks"],
)  # fmt: skip
def test_start_up_rules_for_the_launch_s_ranks_are_checked_before_workers_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
    launch_args: list[str], message: str,
) -> None:  # fmt: skip
    """The rules every rank would apply at start-up (the batch over the ranks, the parallel
    layout, the experts over ep) for the number of ranks the launch starts: one line, exit 2,
    in the launcher, instead of every worker failing after torchrun started them all."""
    from launch.torchrun import main

    monkeypatch.chdir(tmp_path)
    assert main(["--dry-run", *launch_args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1, err


def test_the_sbatch_templates_name_missing_slurm_commands(tmp_path: Path) -> None:
    for template in ("train.sbatch", "train_srun.sbatch"):
        script = ROOT / "launch" / "slurm" / template
        result = subprocess.run(
            ["/bin/bash", str(script)], capture_output=True, text=True, env={"PATH": str(tmp_path)}
        )
        assert result.returncode == 2 and "not on PATH" in result.stderr, result.stderr


COMMON = [*SMALL_OVERRIDES, "trainer.precision=fp32", "trainer.eval_every=0"]
COMMON += ["trainer.max_steps=6", "checkpoint.every=2"]


def only_run(cwd: Path) -> Path:
    runs = list((cwd / "runs").iterdir())
    assert len(runs) == 1, runs
    return runs[0]


@pytest.fixture(scope="module")
def uninterrupted(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    cwd = tmp_path_factory.mktemp("uninterrupted")
    result = launch("--nproc-per-node=2", f"data.path={dataset}", *COMMON, cwd=cwd)
    assert result.returncode == 0, result.stderr[-4000:]
    return train_losses(only_run(cwd))


@pytest.mark.integration
@pytest.mark.distributed
def test_an_elastic_restart_resumes_and_matches_the_uninterrupted_run(
    dataset: Path, tmp_path: Path, uninterrupted: dict[int, float]
) -> None:
    fault = ["trainer.fault_step=3", "trainer.fault_rank=1"]
    args = ["--nproc-per-node=2", "--max-restarts=1", f"data.path={dataset}", *COMMON, *fault]
    result = launch(*args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    run_dir = only_run(tmp_path)  # the restart kept torchrun's run id, so the run directory
    log = (run_dir / "train.log").read_text()
    assert "resumed from" in log and "step_00000002" in log  # the newest checkpoint at the crash
    assert (run_dir / ".fault_step_3_rank1").exists() and not (
        run_dir / ".fault_step_3_rank0"
    ).exists()
    assert train_losses(run_dir) == uninterrupted  # steps 3-6 recomputed bitwise


@pytest.mark.integration
@pytest.mark.distributed
def test_two_nodes_on_localhost_train_together(
    dataset: Path, tmp_path: Path, uninterrupted: dict[int, float]
) -> None:
    port = free_port()
    node = ["--nnodes=2", "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}"]
    node += ["--rdzv-id=two-nodes"]
    env = os.environ | OFFLINE | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "launch.torchrun", *node]
    overrides = [f"data.path={dataset}", *COMMON]
    logs = [tmp_path / f"node{rank}.log" for rank in (0, 1)]
    nodes = []
    try:
        for rank, log in enumerate(logs):
            with log.open("w") as out:  # files, not pipes: no node can block on a full pipe
                nodes.append(
                    subprocess.Popen(
                        [*command, f"--node-rank={rank}", *overrides],
                        cwd=tmp_path,
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        for process, log in zip(nodes, logs):
            assert process.wait(timeout=600) == 0, log.read_text()[-4000:]
    finally:
        for process in nodes:  # whatever is left (a failed or timed-out launch) goes
            if process.poll() is None:
                os.killpg(process.pid, 9)
    run_dir = only_run(tmp_path)
    assert run_dir.name == "torchrun-two-nodes"  # both nodes wrote to the rendezvous id's dir
    assert "world 2" in (run_dir / "train.log").read_text()
    got = train_losses(run_dir)
    assert got.keys() == uninterrupted.keys()
    for step, loss in uninterrupted.items():  # the same 2 ranks, only the launch differs
        assert got[step] == pytest.approx(loss, rel=1e-6)
