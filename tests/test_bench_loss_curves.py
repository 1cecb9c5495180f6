"""bench/loss_curves.py's record: naming cases re-records only those and keeps the file's others;
without names it writes the whole set afresh."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "loss_curves.py"


@pytest.fixture
def loss_curves(monkeypatch):
    spec = importlib.util.spec_from_file_location("loss_curves_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fresh = {"a": {"loss": [1.0]}, "b": {"loss": [2.0]}}  # what the cases would train to now
    monkeypatch.setattr(module, "run_all", lambda only: {k: fresh[k] for k in only or fresh})
    return module


def test_recording_named_cases_keeps_the_others(loss_curves, tmp_path):
    path = tmp_path / "reference.json"
    path.write_text(json.dumps({"a": {"loss": [9.0]}, "c": {"loss": [3.0]}}))
    assert loss_curves.main(["record", str(path), "a"]) == 0
    assert json.loads(path.read_text()) == {"a": {"loss": [1.0]}, "c": {"loss": [3.0]}}
    assert loss_curves.main(["compare", str(path), "a"]) == 0


def test_recording_all_cases_replaces_the_file(loss_curves, tmp_path):
    path = tmp_path / "reference.json"
    path.write_text(json.dumps({"c": {"loss": [3.0]}}))
    assert loss_curves.main(["record", str(path)]) == 0
    assert json.loads(path.read_text()) == {"a": {"loss": [1.0]}, "b": {"loss": [2.0]}}
    assert loss_curves.main(["compare", str(path), "b"]) == 0
    path.write_text(json.dumps({"b": {"loss": [2.5]}}))
    assert loss_curves.main(["compare", str(path), "b"]) == 1
