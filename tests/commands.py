"""Running the project's commands (`python -m <module> overrides...`) in a subprocess, offline."""

from __future__ import annotations

import os
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
