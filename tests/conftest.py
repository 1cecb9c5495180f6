"""Test tiers (DESIGN.md section 9): unmarked = unit; `distributed`, `integration`, `slurm`, `gpu`.

`pytest` runs every tier this machine can run: `gpu` tests skip without CUDA; `slurm` tests start
a single-node SLURM themselves (tests/launch/test_slurm.py) and skip when its Debian packages are
not installed, unless LMFORGE_REQUIRE_SLURM=1 (set by .ci/run, which installs them).
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
