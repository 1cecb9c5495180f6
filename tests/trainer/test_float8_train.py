"""`python -m trainer trainer.precision=float8` end to end: a MoE model trains with MXFP8 (its
experts' grouped GEMMs emulated on CPU), the filter's choices in the log; its checkpoint exports
to bf16 safetensors and the run resumes in bf16 from it; DeepSpeed with float8 is refused in one line."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.commands import run_module
from tests.trainer.helpers import SMALL_OVERRIDES, metric_rows, run_trainer

pytestmark = pytest.mark.integration
pytest.importorskip("torchao")


def _args(dataset: Path, run_dir: Path, *extra: str) -> list[str]:
    # Mixtral's shape (the family the export writes): no shared expert, no selection bias, no
    # dense first layer
    mixtral = ("n_shared_experts=0", "bias_update_rate=0", "first_k_dense=0")
    moe = ("model=tiny_moe", *(f"model.moe.{setting}" for setting in mixtral))
    return [f"data.path={dataset}", f"hydra.run.dir={run_dir}", *moe, *SMALL_OVERRIDES, *extra]


def test_a_float8_run_trains_and_resumes_in_bf16(dataset: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    float8 = ("trainer.precision=float8", "trainer.float8.recipe=mxfp8", "trainer.float8.filter=all")  # fmt: skip
    first = run_trainer(*_args(dataset, run_dir, "trainer.max_steps=3", *float8), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    log = (run_dir / "train.log").read_text()
    assert "float8 (mxfp8): " in log and "experts by mxfp8" in log
    assert "kept in bf16 (router (its scores pick the experts)): layers.*.ffn.router.gate" in log
    losses = [r["loss"] for r in metric_rows(run_dir) if "loss" in r]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    exported = run_module("trainer.export", f"path={run_dir}", f"out={tmp_path / 'hf'}", "dtype=bf16", cwd=tmp_path)  # fmt: skip
    assert exported.returncode == 0, exported.stderr[-3000:]
    for shard in (tmp_path / "hf").glob("*.safetensors"):  # the float8 run's weights, in bf16
        with safe_open(str(shard), "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118
    second = run_trainer(
        *_args(dataset, run_dir, "trainer.max_steps=5", "trainer.precision=bf16"), cwd=tmp_path
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in (run_dir / "train.log").read_text()
    steps = [r["step"] for r in metric_rows(run_dir) if "loss" in r]
    assert steps == [1, 2, 3, 4, 5]


def test_deepspeed_with_float8_is_refused_in_one_line(dataset: Path, tmp_path: Path) -> None:
    extra = ("parallel.engine=deepspeed", "trainer.precision=float8", "trainer.max_steps=1")
    result = run_trainer(*_args(dataset, tmp_path / "run", *extra), cwd=tmp_path)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, result.stderr[-2000:]
    assert "trainer.precision=float8 is not available with parallel.engine=deepspeed" in errors[0]
    assert "Traceback" not in result.stderr
