"""Running the project's commands (`python -m <module> overrides...`) in a subprocess, offline;
also on a small tmpfs (a full or read-only disk) in a user namespace, without root."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


def run_module(
    module: str, *overrides: str, cwd: Path, env: dict | None = None, timeout: int = 600
) -> subprocess.CompletedProcess:
    full_env = os.environ | OFFLINE | {"PYTHONPATH": str(ROOT)} | (env or {})
    return subprocess.run(
        [sys.executable, "-m", module, *overrides],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=full_env,
        timeout=timeout,
    )


UNSHARE = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c"]


@functools.cache
def can_mount_tmpfs() -> bool:
    """Whether this machine lets a user namespace mount a tmpfs (run_on_tmpfs's requirement)."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run([*UNSHARE, "mount -t tmpfs none /mnt"], capture_output=True)
    return probe.returncode == 0


def run_on_tmpfs(
    disk: Path, options: str, shell_command: str, cwd: Path, timeout: int = 600
) -> subprocess.CompletedProcess:
    """`shell_command` (sh) after mounting a tmpfs with `options` (`size=64k`, `ro`) on the
    existing directory `disk`, in a namespace of its own: the mount goes away with it."""
    script = f"mount -t tmpfs -o {options} none {disk} && {shell_command}"
    return subprocess.run(
        [*UNSHARE, script],
        cwd=cwd,
        env=os.environ | OFFLINE | {"PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
