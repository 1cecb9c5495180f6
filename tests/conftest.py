"""Test tiers (README.md, "Tests"): unmarked = unit; `distributed`, `integration`, `slurm`, `gpu`.

`pytest` runs every tier this machine can run: `gpu` tests skip without CUDA; `slurm` tests start
a single-node SLURM themselves (tests/launch/test_slurm.py) and skip when its Debian packages are
not installed, unless LMFORGE_REQUIRE_SLURM=1 (set by .ci/run, which installs them).
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

# Triton kernels run under Triton's interpreter on a machine without CUDA; the flag must be set
# before triton is first imported (torch.compile may import it), so here, before any test
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# the trainers that tests start keep their measured MFU peaks to themselves (a peak measured
# while the suite loads the machine must not reach the user's ~/.cache/lmforge)
os.environ.setdefault("LMFORGE_CACHE_DIR", tempfile.mkdtemp(prefix="lmforge-test-cache-"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
LAUNCHER_VARIABLES += ("MASTER_PORT", "NPROC_PER_NODE", "TORCHELASTIC_RUN_ID", "GROUP_RANK")


@pytest.fixture(autouse=True)
def _no_launcher_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests start from a plain environment even when pytest itself runs inside a SLURM
    allocation or under torchrun: their subprocesses must not inherit a launch's variables."""
    import os

    for key in list(os.environ):
        if key.startswith("SLURM_") or key in LAUNCHER_VARIABLES:
            monkeypatch.delenv(key)
