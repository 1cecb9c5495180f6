"""`python -m trainer` as users and hostile environments run it (issue 13): a config that does not
fit the checkpoint exits 2 and touches nothing, a busy run directory is refused, runs started in
the same second get their own directories, Ctrl-C saves, settings errors stop before any file is
written, and a disk that fills up gives one line."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from model.errors import ConfigError
from tests.commands import OFFLINE, ROOT, can_mount_tmpfs, run_on_tmpfs
from tests.trainer.helpers import SMALL_OVERRIDES, metric_rows, run_trainer
from trainer import run_dir as run_dirs
from trainer.config import TrainerConfig
from trainer.signals import StopFlag

pytestmark = pytest.mark.integration


def small(dataset: Path, run_dir: Path | None, *extra: str) -> list[str]:
    where = [f"hydra.run.dir={run_dir}"] if run_dir is not None else []
    return [f"data.path={dataset}", *where, *SMALL_OVERRIDES, "trainer.eval_every=0", *extra]


class Started(subprocess.Popen):
    """A trainer in the background whose output goes to a file (a pipe that nobody reads while
    it runs would fill up and block the trainer's logging)."""

    log: Path

    def output(self) -> str:
        return self.log.read_text()


def start(args: list[str], cwd: Path) -> Started:
    env = os.environ | OFFLINE | {"PYTHONPATH": str(ROOT)}
    log = cwd / f"trainer-{len(list(cwd.glob('trainer-*.log')))}.log"
    with open(log, "w") as out:
        proc = Started(
            [sys.executable, "-m", "trainer", *args],
            cwd=cwd,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=out,
        )
    proc.log = log
    return proc


def wait_for_rows(proc: subprocess.Popen, run_dir: Path, rows: int = 3) -> None:
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= rows):
        assert proc.poll() is None, proc.output()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_config_that_does_not_fit_the_checkpoint_exits_2_and_keeps_the_run(dataset, tmp_path):
    run_dir = tmp_path / "run"
    args = small(dataset, run_dir, "trainer.max_steps=2", "checkpoint.every=2")
    assert run_trainer(*args, cwd=tmp_path).returncode == 0
    rows = (run_dir / "metrics.jsonl").read_text()
    listing = sorted(str(p) for p in (run_dir / "checkpoints").rglob("*"))
    result = run_trainer(*args, "trainer.max_steps=4", "model.n_layers=1", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "model.n_layers=2 in the checkpoint, 1 now" in result.stderr
    assert "damaged" not in result.stderr and "Traceback" not in result.stderr
    assert (run_dir / "metrics.jsonl").read_text() == rows
    assert sorted(str(p) for p in (run_dir / "checkpoints").rglob("*")) == listing


def test_a_busy_run_directory_is_refused_and_ctrl_c_saves(dataset, tmp_path):
    run_dir = tmp_path / "run"
    first = start(small(dataset, run_dir, "trainer.max_steps=100000"), tmp_path)
    try:
        wait_for_rows(first, run_dir)
        second = run_trainer(*small(dataset, run_dir, "trainer.max_steps=2"), cwd=tmp_path)
        assert second.returncode == 2
        assert f"is in use by pid {first.pid}" in second.stderr
        assert "Traceback" not in second.stderr
        first.send_signal(signal.SIGINT)  # Ctrl-C: save at the end of the step, exit 130
        assert first.wait(timeout=120) == 130
    finally:
        first.kill()
    log = (run_dir / "train.log").read_text()
    assert "stopped by SIGINT" in log and "Traceback" not in first.output()
    step = int((run_dir / "checkpoints" / "latest").read_text().strip().split("_")[1])
    assert 3 <= step < 100000
    assert max(r["step"] for r in metric_rows(run_dir)) <= step + 1


def test_a_second_ctrl_c_exits_at_once(monkeypatch):
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    stop = StopFlag()
    stop._handler(signal.SIGINT, None)
    assert stop.requested() and stop.name() == "SIGINT" and exits == []
    stop._handler(signal.SIGINT, None)
    assert exits == [130]


def test_runs_started_in_the_same_second_get_their_own_directories(dataset, tmp_path):
    procs = [start(small(dataset, None, "trainer.max_steps=1"), tmp_path) for _ in range(2)]
    for proc in procs:
        assert proc.wait(timeout=300) == 0, proc.output()[-3000:]
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 2 and all((r / "metrics.jsonl").is_file() for r in runs)


def test_claiming_a_name_taken_in_the_same_second_adds_a_suffix(tmp_path):
    base = tmp_path / "runs" / "2026-12-01_08-00-00"
    assert run_dirs.claim_unique(base) == base
    assert run_dirs.claim_unique(base).name == "2026-12-01_08-00-00-2"
    assert run_dirs.claim_unique(base).name == "2026-12-01_08-00-00-3"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optim.name=adamx", "optim.name='adamx' is not one of: adamw, muon"),
        ("trainer.spike_factor=-2", "trainer.spike_factor=-2.0 must be 0 or > 1 (0 = off"),
        ("parallel.ep=2", "parallel.ep=2"),
        ("trainer.batch_size=3", "trainer.batch_size=3 is not divisible"),
    ],
)
def test_settings_errors_touch_no_file(tmp_path, override, message):
    """With the default corpus not prepared yet: nothing is prepared, no run directory is left."""
    data_dir = tmp_path / "data"
    run_dir = tmp_path / "run"
    result = run_trainer(
        f"hydra.run.dir={run_dir}",
        override,
        "trainer.micro_batch_size=2",
        "logging.progress=false",
        cwd=tmp_path,
        env={"LMFORGE_DATA_DIR": str(data_dir)},
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not run_dir.exists() and not data_dir.exists()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.batch_size=abc", "trainer.batch_size=abc: Value 'abc' of type 'str'"),
        ("trainer.nonsense=1", "trainer.nonsense is not a setting (TrainerConfig has no field"),
        ("+trainer.nonsense=1", "trainer.nonsense is not a setting"),
        ("model=nonexistent", "model=nonexistent is not a preset of model: choose one of"),
        ("optim.weight_decay=inf", "optim.weight_decay=inf must be finite and >= 0"),
        ("trainer.grad_clip=nan", "trainer.grad_clip=nan must be finite and >= 0 (0 = off)"),
        ("data.seq_len=0", "data.seq_len=0 must be >= 1"),
    ],
)
def test_a_settings_error_is_one_line_and_creates_nothing(tmp_path, override, message):
    """Issue 52, bug 11: Hydra's errors (a type, an unknown key or preset) and the config
    dataclasses' rules stop before a run directory (or `runs/`) exists, in one line, exit 2."""
    result = run_trainer(override, "logging.progress=false", cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    assert message in lines[0] and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_help_and_the_config_printouts_create_nothing(tmp_path):
    for flags in (["--help"], ["--cfg", "job"], ["--info", "defaults"]):
        result = run_trainer(*flags, cwd=tmp_path)
        assert result.returncode == 0 and result.stdout, (flags, result.stderr[-3000:])
        assert list(tmp_path.iterdir()) == [], flags


def test_a_missing_dataset_keeps_its_exit_code_and_leaves_no_run_directory(tmp_path):
    missing = tmp_path / "missing"
    result = run_trainer(f"data.path={missing}", "logging.progress=false", cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    assert f"no manifest.json in {missing}" in result.stderr and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_flex_attention_on_a_cpu_is_one_line_at_start_and_leaves_no_run_directory(
    dataset, tmp_path
):
    result = run_trainer(
        f"data.path={dataset}", *SMALL_OVERRIDES, "model.attention.backend=flex", cwd=tmp_path
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "model.attention.backend=flex trains on CUDA only" in result.stderr
    assert "Traceback" not in result.stderr and list(tmp_path.iterdir()) == []


def test_only_a_run_directory_that_never_trained_is_removed(tmp_path):
    fresh = run_dirs.claim_unique(tmp_path / "runs" / "a")
    trained = run_dirs.claim_unique(tmp_path / "runs" / "b")
    for run_dir in (fresh, trained):
        run_dirs.lock(run_dir)
        (run_dir / ".hydra").mkdir()
        (run_dir / "train.log").write_text("started\n")
    (trained / "metrics.jsonl").write_text('{"step": 1}\n')
    adopted = tmp_path / "adopted"  # there before this launch: never removed
    adopted.mkdir()
    assert not run_dirs.remove_if_unused(adopted)
    assert not run_dirs.remove_if_unused(trained) and (trained / "metrics.jsonl").is_file()
    assert run_dirs.remove_if_unused(fresh) and not fresh.exists()
    assert (tmp_path / "runs").is_dir()  # still holds `trained`
    (trained / "metrics.jsonl").unlink()
    assert run_dirs.remove_if_unused(trained) and not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("key", "value", "rule"),
    [
        ("grad_clip", math.inf, "must be finite and >= 0 (0 = off)"),
        ("grad_clip", -1.0, "must be >= 0"),
        ("spike_factor", math.nan, "must be finite and 0 or > 1"),
        ("spike_factor", 0.5, "must be 0 or > 1"),
        ("peak_flops", -1e12, "must be >= 0"),
        ("peak_flops", math.inf, "must be finite and >= 0"),
        ("orphan_grace_s", math.inf, "must be finite and >= 0"),
        ("max_steps", 0, "must be >= 1"),
        ("max_bad_steps", 0, "must be >= 1"),
        ("fault_rank", -2, "must be >= -1"),
    ],
)
def test_a_bad_trainer_number_is_refused_naming_the_field(key, value, rule):
    with pytest.raises(ConfigError) as refused:
        TrainerConfig(**{key: value})
    assert str(refused.value).startswith(f"trainer.{key}={value} {rule}")


def test_without_validation_no_validation_rows_are_written(dataset, tmp_path):
    run_dir = tmp_path / "run"
    result = run_trainer(
        *small(dataset, run_dir, "trainer.max_steps=2", "data.val_batches=0"), cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert not [r for r in metric_rows(run_dir) if "val_loss" in r]
    assert "validation loss" not in (run_dir / "train.log").read_text()


@pytest.mark.skipif(not can_mount_tmpfs(), reason="needs unshare and a user namespace for tmpfs")
def test_a_full_disk_is_one_line_that_names_what_was_kept(dataset, tmp_path):
    """The run directory on a 3 MiB tmpfs: the first checkpoint fits, a later one does not."""
    disk = tmp_path / "disk"
    disk.mkdir()
    args = small(dataset, disk / "run", "trainer.max_steps=40", "checkpoint.every=1")
    args += ["checkpoint.keep=40"]
    command = f"exec {sys.executable} -m trainer " + " ".join(f"'{a}'" for a in args)
    result = run_on_tmpfs(disk, "size=3m", command, cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if "no space left on" in line]
    assert lines and "the newest complete checkpoint is" in lines[0], result.stderr[-3000:]
    assert "Free space and run the same command again" in lines[0]
    assert "Traceback" not in result.stderr and "unexpected pos" not in result.stderr
