"""`python -m data.prepare` end to end: Hydra overrides, exit codes, messages without tracebacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def run_prepare(*overrides: str, cwd: Path) -> subprocess.CompletedProcess:
    env = os.environ | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "data.prepare", *overrides],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=300,
    )


def test_prepare_trains_a_tokenizer_and_writes_shards(corpus_dir, tmp_path):
    out = tmp_path / "out"
    args = (f"source={corpus_dir}", f"out={out}", "tokenizer=train", "vocab_size=300", "workers=2")
    result = run_prepare(*args, "progress=false", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["tokenizer"]["vocab_size"] == 300 and manifest["dtype"] == "uint16"
    assert manifest["splits"]["train"]["tokens"] > 0
    log = (out / "prepare.log").read_text()
    assert "wrote" in log and "tokenized" in log
    assert not (tmp_path / "outputs").exists() and not (tmp_path / ".hydra").exists()
    again = run_prepare(*args, "progress=false", cwd=tmp_path)
    assert again.returncode == 0 and "already prepared" in again.stderr


@pytest.mark.parametrize(
    ("overrides", "code", "message"),
    [
        (["source={tmp}/missing"], 1, "source={tmp}/missing does not exist"),
        (["val_fraction=2"], 2, "val_fraction=2.0 must be in [0, 1)"),
        (["vocab=10"], 1, "Key 'vocab' not in 'PrepareConfig'"),
        (["source=hf:nobody/no-such-dataset"], 1, "could not be loaded"),
        (["source={corpus}", "tokenizer=nonsense"], 1, "tokenizer=nonsense is not a directory"),
    ],
)
def test_bad_input_fails_with_a_message_and_no_traceback(
    corpus_dir, tmp_path, overrides, code, message
):
    fill = {"tmp": tmp_path, "corpus": corpus_dir}
    args = [o.format(**fill) for o in overrides] + [f"out={tmp_path / 'out'}", "progress=false"]
    result = run_prepare(*args, cwd=tmp_path)
    assert result.returncode == code, result.stderr
    assert message.format(**fill) in result.stderr
    assert "Traceback" not in result.stderr
