"""`python -m data.prepare` end to end: Hydra overrides, exit codes, messages without tracebacks."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.commands import ROOT, run_module

pytestmark = pytest.mark.integration


def run_prepare(*overrides: str, cwd: Path) -> subprocess.CompletedProcess:
    return run_module("data.prepare", *overrides, cwd=cwd, timeout=300)


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


def test_bpe_training_shows_our_bars_not_rustbpes_log(corpus_dir, tmp_path):
    """rustbpe logs a line per percent of the merges: none reaches the console or prepare.log. The
    BPE input bar counts up to the corpus, not to the 1e9-character cap, and ends at 100%."""
    out = tmp_path / "out"
    args = (f"source={corpus_dir}", f"out={out}", "vocab_size=1000", "workers=1")
    result = run_prepare(*args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for text in (result.stderr, (out / "prepare.log").read_text()):
        assert "rustbpe" not in text and "Progress:" not in text
    bars = re.findall(r"BPE input: +(\d+)%\|[^|]*\| ([\d.]+[kMG]?)/([\d.]+[kMG]?) ", result.stderr)
    assert bars, result.stderr
    assert all(total != "1.00G" for _, _, total in bars)
    percent, done, total = bars[-1]
    assert percent == "100" and done == total
    assert "BPE merges: 100%" in result.stderr
    assert "learned 743 BPE merges" in result.stderr


def test_help_lists_the_settings_of_prepare_only(tmp_path):
    """conf/ also holds the trainer's groups; `data.prepare --help` does not list them."""
    result = run_module("data.prepare", "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "vocab_size: 8192" in result.stdout and "tokenizer_train_chars:" in result.stdout
    for trainer_only in ("Configuration groups", "optim", "llama3_8b", "parallel", "checkpoint"):
        assert trainer_only not in result.stdout


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


def test_a_killed_run_resumes_to_the_same_bytes(tokenizer_dir, tmp_path):
    """SIGKILL (no cleanup at all) once the first shards are committed, then run again: the
    result equals an uninterrupted run's, file for file."""
    common = [
        "source=stdlib",
        "max_documents=250",
        "shard_tokens=20000",
        f"tokenizer={tokenizer_dir}",
        "workers=1",
        "progress=false",
    ]
    killed = tmp_path / "killed"
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "data.prepare", *common, f"out={killed}"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not (killed / "train" / "00002.json").exists():
            assert proc.poll() is None, "preparation ended before it could be interrupted"
            assert time.monotonic() < deadline, "no shard committed within 120 s"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert not (killed / "manifest.json").exists()
    assert run_prepare(*common, f"out={killed}", cwd=tmp_path).returncode == 0
    whole = tmp_path / "whole"
    assert run_prepare(*common, f"out={whole}", cwd=tmp_path).returncode == 0
    files = sorted(p.relative_to(whole) for p in whole.rglob("*") if p.is_file())
    assert len(files) > 20
    for rel in files:
        if rel.name != "prepare.log":
            assert (killed / rel).read_bytes() == (whole / rel).read_bytes(), rel
    assert sorted(p.relative_to(killed) for p in killed.rglob("*") if p.is_file()) == files
