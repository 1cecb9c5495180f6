"""The run directory of one launch: chosen before Hydra writes into it, and locked while in use.

- `hydra.run.dir=<dir>` names it; without it every rank of a launch computes the same default
  (`runs/slurm-<job id>`, `runs/torchrun-<run id>`), and a single process takes
  `runs/<timestamp>`, with `-2`, `-3`, ... when another run took that name in the same second
  (claimed with an atomic mkdir).
- Rank 0 holds an exclusive lock (`<run dir>/.lock`, flock) for the whole run: a second trainer
  on the same directory stops at once with the holder's pid instead of mixing its rows and
  checkpoints in. The lock goes with the process, so a killed run leaves nothing to clean up.
- A launch that created the directory and stops before training on an error the user can fix
  (settings, data) removes it again.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import TextIO

from model.errors import ConfigError

LOCK_FILE = ".lock"
# what a run directory holds before training begins: the lock, Hydra's resolved config, the
# logs, Engram's token map (trainer/app.py); anything else means the run trained
STARTUP_ENTRIES = frozenset({LOCK_FILE, ".hydra", "train.log", "logs", "token_compression.json"})
_held: dict[Path, TextIO] = {}  # run directories this process has locked
_created: set[Path] = set()  # run directories this launch created
_parents_made: list[Path] = []  # their parents that this launch created, outermost first


class RunDirError(ConfigError):
    """The run directory cannot be used (not writable, or in use by another trainer)."""


def explicit_run_dir(overrides: list[str]) -> str | None:
    for override in overrides:
        if override.startswith(("hydra.run.dir=", "++hydra.run.dir=", "+hydra.run.dir=")):
            return override.split("=", 1)[1]
    return None


def check_writable(run_dir: Path) -> None:
    """The run directory must be creatable: checked before anything makes it, so a bad path
    gives one line instead of a traceback."""
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:  # a real write: permission bits say nothing to root or on read-only mounts
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        raise RunDirError(
            f"run directory {run_dir} cannot be created: {existing} is not writable "
            f"({err.strerror}); pass hydra.run.dir=<a writable path>"
        ) from None


def claim_unique(base: Path) -> Path:
    """`base`, or `base-2`, `base-3`, ...: the first name this process creates itself."""
    for n in range(1, 10_000):
        candidate = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            _make(candidate)
        except FileExistsError:
            continue
        return candidate
    raise RunDirError(f"no free run directory name next to {base}; pass hydra.run.dir=<dir>")


def create(run_dir: Path) -> None:
    """Make `run_dir` (and remember whether this launch made it)."""
    if not run_dir.exists():
        _make(run_dir, exist_ok=True)


def _make(run_dir: Path, exist_ok: bool = False) -> None:
    """mkdir -p that remembers what it made: the run directory and its missing parents (`runs/`
    in a fresh checkout), so that remove_if_unused can take back all of it."""
    for _ in range(3):  # another launch may remove an empty parent between the two mkdirs
        for parent in reversed(run_dir.parents):
            if not parent.exists():
                try:
                    parent.mkdir()
                    _parents_made.append(parent.resolve())
                except FileExistsError:
                    pass
        try:
            run_dir.mkdir(exist_ok=exist_ok)
        except FileNotFoundError:
            continue
        _created.add(run_dir.resolve())
        return
    run_dir.mkdir(parents=True, exist_ok=exist_ok)  # the last try: its error says what is wrong
    _created.add(run_dir.resolve())


ORPHAN_WAIT_S = 60.0  # a killed run's forked workers (data loaders) hold its lock until they exit


def _holder_is_dead(holder: str) -> bool:
    """Whether the lock file names a process of this host that no longer exists (its children
    still hold the inherited lock for a few seconds after a `kill -9`)."""
    parts = holder.split()
    if len(parts) < 4 or parts[0] != "pid" or parts[2] != "on" or not parts[1].isdigit():
        return False
    if parts[3] != socket.gethostname():
        return False
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _busy_message(run_dir: Path, holder: str) -> str:
    if _holder_is_dead(holder):
        return (
            f"run directory {run_dir} is still locked by the children of {holder}, which has "
            f"exited, after {ORPHAN_WAIT_S:.0f} s: stop them (`fuser {run_dir / LOCK_FILE}` "
            "names them), or pass another hydra.run.dir"
        )
    return (
        f"run directory {run_dir} is in use by {holder}: wait for that run to finish, or "
        f"pass another hydra.run.dir"
    )


def lock(run_dir: Path) -> None:
    """Hold `run_dir`'s lock for the rest of this process (a no-op when already held)."""
    key = run_dir.resolve()
    if key in _held:
        return
    create(run_dir)
    handle = open(run_dir / LOCK_FILE, "a+")  # noqa: SIM115  (kept open: the lock lives with it)
    waited = False
    deadline = time.monotonic() + ORPHAN_WAIT_S
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            if not _holder_is_dead(holder) or time.monotonic() > deadline:
                handle.close()
                raise RunDirError(_busy_message(run_dir, holder)) from None
            if not waited:  # the run was killed: its forked workers exit once they notice
                waited = True
                print(
                    f"waiting for the processes of the killed run ({holder}) to exit",
                    file=sys.stderr,
                )
            time.sleep(0.5)
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%F %T')}\n")
    handle.flush()
    _held[key] = handle


def release(run_dir: Path) -> None:
    handle = _held.pop(run_dir.resolve(), None)
    if handle is not None:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def remove_if_unused(run_dir: Path) -> bool:
    """Delete `run_dir` when this launch created it and it holds only what start-up writes
    (STARTUP_ENTRIES: no metrics, no checkpoint); True if removed. After an error that stopped
    the run before it trained, the directory holds nothing worth keeping; after one later on, its
    rows and checkpoints stay."""
    key = run_dir.resolve()
    if key not in _created or not run_dir.is_dir():
        return False
    if any(entry.name not in STARTUP_ENTRIES for entry in run_dir.iterdir()):
        return False
    release(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    _created.discard(key)
    for parent in reversed(_parents_made):  # deepest first; one that is not empty stays
        if parent in key.parents:
            try:
                parent.rmdir()
            except OSError:
                break
    return True
