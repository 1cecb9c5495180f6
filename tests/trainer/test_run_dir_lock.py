"""The run directory's lock after a `kill -9`: the killed trainer's forked workers keep the
inherited lock for a few seconds, so a resume started at once waits for them (naming the dead
run) instead of refusing; a live holder is still refused at once."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer import run_dir as run_dirs

HOLD = """
import fcntl, sys, time
handle = open(sys.argv[1], "a+")
fcntl.flock(handle, fcntl.LOCK_EX)
handle.seek(0); handle.truncate(); handle.write(sys.argv[2]); handle.flush()
print("locked", flush=True)
time.sleep(float(sys.argv[3]))
"""


def dead_pid() -> int:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return gone.pid


def hold(run_dir: Path, holder: str, seconds: float) -> subprocess.Popen:
    """A process holding the lock while the lock file names `holder` (a killed trainer's child)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir / run_dirs.LOCK_FILE), holder, str(seconds)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline().strip() == "locked"
    return child


def test_a_lock_left_by_a_killed_run_s_children_is_waited_for(tmp_path, capsys):
    run_dir = tmp_path / "run"
    holder = f"pid {dead_pid()} on {socket.gethostname()} since 2026-12-06 08:00:00"
    child = hold(run_dir, holder, 2.0)
    start = time.monotonic()
    try:
        run_dirs.lock(run_dir)
        assert time.monotonic() - start >= 1.0  # it waited for the orphan to let go
        assert "waiting for the processes of the killed run" in capsys.readouterr().err
    finally:
        run_dirs.release(run_dir)
        child.wait()


def test_a_live_holder_is_refused_at_once_and_orphans_only_until_the_deadline(
    tmp_path, monkeypatch
):
    run_dir = tmp_path / "run"
    alive = hold(run_dir, f"pid {1} on {socket.gethostname()} since then", 30.0)
    try:
        start = time.monotonic()
        with pytest.raises(run_dirs.RunDirError, match="is in use by pid 1 on"):
            run_dirs.lock(run_dir)
        assert time.monotonic() - start < 1.0
    finally:
        alive.kill()
        alive.wait()
    monkeypatch.setattr(run_dirs, "ORPHAN_WAIT_S", 0.5)
    orphan = hold(run_dir, f"pid {dead_pid()} on {socket.gethostname()} since then", 30.0)
    try:
        with pytest.raises(run_dirs.RunDirError, match="children of pid .* which has exited"):
            run_dirs.lock(run_dir)
    finally:
        orphan.kill()
        orphan.wait()
