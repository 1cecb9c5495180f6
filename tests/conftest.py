"""Test tiers (DESIGN.md section 9): unmarked = unit; `distributed`, `integration`, `slurm`, `gpu`.

`pytest` runs every tier this machine can run: `gpu` tests skip without CUDA, `slurm` tests skip
without a reachable SLURM controller.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch


def _slurm_available() -> bool:
    if shutil.which("sinfo") is None:
        return False
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
    needs_slurm = any("slurm" in item.keywords for item in items)
    skip_slurm = pytest.mark.skip(
        reason="needs a running SLURM cluster (launch/slurm/local_cluster.sh start)"
    )
    slurm_ok = needs_slurm and _slurm_available()
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "slurm" in item.keywords and not slurm_ok:
            item.add_marker(skip_slurm)
