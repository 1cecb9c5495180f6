"""The GPU session's plan (bench/gpu_plan.py) on CPU: every case's code runs in a dry run (tiny
shapes, Triton's interpreter), so that the script a rare GPU session depends on cannot rot; a
case past its cap is killed with its process group while the others' results stay; a second
call resumes where the first stopped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest

from bench import gpu_plan
from tests.trainer.concurrent import concurrently

ROOT = Path(__file__).resolve().parent.parent
# the dry run in two processes side by side (one thread each: tiny shapes), about equal halves
HEAVY = ["attention", "dense_1b_muonclip_triton", "gpu_tests", "fused_kernels"]


def dry_run(names: list[str], out: Path) -> subprocess.CompletedProcess:
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, str(ROOT / "bench" / "gpu_plan.py"), "--dry-run", "--out", str(out)]
    return subprocess.run(
        [*argv, "--only", *names], cwd=out.parent, env=env, capture_output=True, text=True
    )


def errors_in(tree: object, path: str = "") -> list[str]:
    """Every 'error' recorded anywhere in a case's results (sub-cases record theirs and go on)."""
    if isinstance(tree, dict):
        found = [f"{path}: {tree['error']}"] if "error" in tree else []
        for key, value in tree.items():
            found += errors_in(value, f"{path}/{key}")
        return found
    return []


def test_every_case_of_the_plan_runs_on_cpu(tmp_path: Path) -> None:
    light = [case.name for case in gpu_plan.PLAN if case.name not in HEAVY]
    outs = [tmp_path / "a" / "out", tmp_path / "b" / "out"]
    for out in outs:
        out.parent.mkdir()
    runs = concurrently(*(partial(dry_run, names, out) for names, out in zip((HEAVY, light), outs)))
    for run in runs:
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    cases = {}
    for out in outs:
        cases |= json.loads((out / "gpu_session.json").read_text())["cases"]
    assert set(cases) == set(gpu_plan.CASES)
    for name, entry in cases.items():
        assert entry["status"] == "ok", (name, entry)
        assert not errors_in(entry.get("result", {})), (name, errors_in(entry["result"]))
    train = gpu_plan.train_results(cases)
    for name in ("dense_1b", "moe_fine", "moe", "hybrid_1b", "attnres_1b", "mhc_1b", "engram_1b"):
        assert train[name]["tokens_per_s"] > 0 and train[name]["active_params"] > 0, name
    assert train["moe_fine"]["active_params"] < train["moe_fine"]["params"]  # routed experts
    assert train["dense_1b_32k"]["model"]["activation_checkpoint"] == "selective"
    assert "fla-core" in train["hybrid_1b_fla"]["skipped"]  # not installed on the CPU machine
    assert "float8 (tensorwise)" in train["dense_1b_float8_tensorwise"]["float8"]
    comparisons = gpu_plan.targets(cases)["comparisons"]
    assert comparisons["mhc_1b"]["step_time_vs_dense_1b"] > 0  # dense_1b ran in the other half
    assert comparisons["dense_1b_float8_tensorwise"]["speedup_vs_bf16"] > 0
    timing = cases["attention"]["result"]["flash_attention"]["timing"]
    assert set(timing) >= {"dense_t4096_d128", "dense_t16384_d128", "mla_t4096"}
    main_shape = timing["dense_t4096_d128"]
    # ours with and without max logits, the atomic-dQ backward, SDPA (on CUDA: cuDNN, FA2, Flex)
    assert {"triton_max_logits", "triton", "triton_max_logits_single_pass"} <= set(main_shape)
    assert "forward_backward" in main_shape["triton_max_logits"] and "sdpa_default" in main_shape
    assert set(main_shape["triton_max_logits_over_best_sdpa"]) == {
        "forward", "backward", "forward_backward"
    }  # fmt: skip
    assert "test_gpu.py" in cases["gpu_tests"]["log_tail"]  # the tier collected, in a subprocess


@pytest.fixture
def two_commands(monkeypatch: pytest.MonkeyPatch) -> dict:
    """A plan of a command that outlives its 2 s cap (with a child of its own) and a quick one."""
    sleeper = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
    sleeper += "'import time; time.sleep(60)']); time.sleep(60)"
    cases = {
        "hangs": gpu_plan.Case("hangs", ("-c", sleeper), 1, 2, "past its cap", command=True),
        "quick": gpu_plan.Case("quick", ("-c", "print('done')"), 1, 30, "quick", command=True),
    }
    monkeypatch.setattr(gpu_plan, "CASES", cases)
    return cases


def test_a_case_past_its_cap_is_killed_and_a_second_call_resumes(
    two_commands: dict, tmp_path: Path
) -> None:
    start = time.monotonic()
    first = gpu_plan.run_plan(["hangs", "quick"], tmp_path, 60, False)
    assert time.monotonic() - start < 25  # the cap (2 s) and the TERM grace, not the 60 s sleep
    assert first["cases"]["hangs"]["status"] == "timed out"
    assert (
        first["cases"]["quick"]["status"] == "ok" and "done" in first["cases"]["quick"]["log_tail"]
    )
    saved = json.loads((tmp_path / "gpu_session.json").read_text())
    assert saved["cases"]["hangs"]["status"] == "timed out"
    two_commands["hangs"] = gpu_plan.Case("hangs", ("-c", "pass"), 1, 30, "fixed", command=True)
    second = gpu_plan.run_plan(
        ["hangs", "quick"], tmp_path, 60, False, tmp_path / "gpu_session.json"
    )
    assert second["cases"]["hangs"]["status"] == "ok"  # rerun
    assert second["cases"]["quick"] == first["cases"]["quick"]  # kept, not rerun


def test_a_case_that_does_not_fit_the_time_left_is_not_started(
    two_commands: dict, tmp_path: Path
) -> None:
    two_commands["quick"] = gpu_plan.Case(
        "quick", ("-c", "pass"), 50, 60, "needs 50 s", command=True
    )
    session = gpu_plan.run_plan(["quick"], tmp_path, 10, False)
    assert session["cases"]["quick"]["status"] == "not run"
    assert "needs ~50" in session["cases"]["quick"]["reason"]
