"""Test tiers (docs/testing.md): unmarked = unit; `distributed`, `integration`, `slurm`, `gpu`.

`pytest` runs every tier this machine can run: `gpu` tests skip without CUDA; `slurm` tests start
a single-node SLURM themselves (tests/launch/test_slurm.py) and skip when its Debian packages are
not installed.

Under CI (`CI` set to anything but "", 0 or false, or LMFORGE_REQUIRE_ALL=1; .ci/run sets both)
nothing skips silently: a skip fails the test, except GPU-only tests without CUDA and skips whose
reason starts with "machine:" (a capability of this processor or C library, not something an
install provides). A missing optional dependency (transformers, deepspeed, triton, SLURM, ...)
therefore fails the run. The summary ends with a line counting the skips by kind.
"""

from __future__ import annotations

import os
import tempfile
from collections import Counter

import pytest
import torch

# Triton kernels run under Triton's interpreter on a machine without CUDA; the flag must be set
# before triton is first imported (torch.compile may import it), so here, before any test
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# the trainers that tests start keep their measured MFU peaks to themselves (a peak measured
# while the suite loads the machine must not reach the user's ~/.cache/lmforge)
os.environ.setdefault("LMFORGE_CACHE_DIR", tempfile.mkdtemp(prefix="lmforge-test-cache-"))


GPU_SKIP = "needs CUDA (torch.cuda.is_available() is False)"
MACHINE_SKIP = "machine:"  # a skip reason's prefix for what no install can provide
_skips: Counter[str] = Counter()


def strict_skips() -> bool:
    """Whether a skip must fail: under CI, or with LMFORGE_REQUIRE_ALL=1."""
    ci = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
    return ci or os.environ.get("LMFORGE_REQUIRE_ALL") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason=GPU_SKIP)
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (file, line, "Skipped: reason")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _judge_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    """Count a skip by kind and, under strict_skips(), turn one that an install could fix into a
    failure that says so."""
    reason = _skip_reason(report)
    kind = "gpu" if reason == GPU_SKIP else "machine" if reason.startswith(MACHINE_SKIP) else None
    if kind is None and strict_skips():
        report.outcome = "failed"
        report.longrepr = (
            f"skipped under CI: {reason} (install what it names; a skip is allowed only for "
            "GPU-only tests and reasons starting with 'machine:')"
        )
        _skips["failed"] += 1
        return
    _skips[kind or "other"] += 1


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail"):  # an expected failure is no skip
        _judge_skip(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    outcome = yield
    report = outcome.get_result()
    if report.skipped:  # a module-level importorskip skips the whole file
        _judge_skip(report)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    mode = "strict (CI)" if strict_skips() else "lenient (set CI=1 to fail on them)"
    terminalreporter.write_line(
        f"lmforge skips: {_skips['gpu']} GPU-only (no CUDA), {_skips['machine']} machine-dependent"
        f", {_skips['other']} other, {_skips['failed']} turned into failures; mode {mode}"
    )


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
