"""`python -m trainer.export` never costs data and leaves nothing half-done (issue 52, items 4, 5,
the export part of 8, and its one-line errors): overwrite=true replaces only a previous export,
never the run, the checkpoint, the working directory or a folder above them; a refused export
(a swapped tokenizer, non-finite weights, a read-only or full disk) leaves no output; nonsense
shard sizes are one line."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.commands import can_mount_tmpfs, run_module, run_on_tmpfs
from tests.trainer.helpers import small_config
from trainer.app import build_training, train
from trainer.export_target import MARKER
from trainer.runtime import Ranks

ONE = Ranks(rank=0, world_size=1, local_rank=0)
POISONED = "layers.1.attn.q_proj.weight"  # made 3 NaN + 2 inf in the non-finite checkpoint
needs_tmpfs = pytest.mark.skipif(
    not can_mount_tmpfs(), reason="needs unshare and a user namespace for tmpfs"
)


@pytest.fixture(scope="module")
def data(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the dataset: the swapped-tokenizer test swaps its tokenizer (and restores it)."""
    copy = tmp_path_factory.mktemp("export_data") / "dataset"
    shutil.copytree(dataset, copy)
    return copy


@pytest.fixture(scope="module")
def run(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One trained run (2 steps, a checkpoint at step 2) shared by the tests, which never change
    it (the tests that try to overwrite it check that it is intact)."""
    run_dir = tmp_path_factory.mktemp("export_run") / "run"
    cfg = small_config(data, max_steps=2)
    cfg.checkpoint.every = 2
    assert train(cfg, run_dir, ONE) == 0
    return run_dir


def export(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return run_module("trainer.export", *args, cwd=cwd)


def one_line_error(result: subprocess.CompletedProcess) -> str:
    """The error line of a refused export: exit 1, one `error:` line, no traceback."""
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    return errors[0]


def snapshot(directory: Path) -> dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_mtime_ns for p in directory.rglob("*")}


def leftovers(parent: Path, name: str) -> list[str]:
    """Temporary siblings of `parent / name` an export left behind."""
    return [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.")]


@pytest.mark.parametrize("where", ["run", "checkpoint", "above_run", "cwd", "above_cwd"])
def test_overwrite_never_replaces_the_run_or_the_working_directory(run, tmp_path, where):
    """out=<run> overwrite=true deleted the run and wrote the export in its place; out=. emptied
    the working directory, then failed with a traceback."""
    cwd = tmp_path / "work" / "here"
    cwd.mkdir(parents=True)
    (cwd / "notes.txt").write_text("mine")
    out = {
        "run": run,
        "checkpoint": run / "checkpoints" / "step_00000002",
        "above_run": run.parent,
        "cwd": Path("."),
        "above_cwd": cwd.parent,
    }[where]
    before, mine = snapshot(run), snapshot(tmp_path)
    line = one_line_error(export(f"path={run}", f"out={out}", "overwrite=true", cwd=cwd))
    what = "the working directory" if "cwd" in where else "being exported"
    assert what in line and "an export never replaces it" in line, line
    assert snapshot(run) == before and snapshot(tmp_path) == mine


def test_overwrite_refuses_a_directory_that_is_not_only_a_previous_export(run, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    line = one_line_error(export(f"path={run}", f"out={other}", "overwrite=true", cwd=tmp_path))
    assert f"no {MARKER}" in line and "remove it yourself" in line, line
    assert (other / "notes.txt").read_text() == "mine"

    # a previous export to which something was added is not replaced either
    hf = tmp_path / "hf"
    assert export(f"path={run}", f"out={hf}", cwd=tmp_path).returncode == 0
    (hf / "README.md").write_text("my model card")
    line = one_line_error(export(f"path={run}", f"out={hf}", "overwrite=true", cwd=tmp_path))
    assert "files an export did not write (README.md)" in line, line
    assert (hf / "README.md").read_text() == "my model card"


def test_overwrite_replaces_a_previous_export(run, tmp_path):
    hf = tmp_path / "hf"
    assert export(f"path={run}", f"out={hf}", cwd=tmp_path).returncode == 0
    assert (hf / MARKER).is_file() and (hf / "tokenizer").is_dir()
    assert '"torch_dtype": "bfloat16"' in (hf / "config.json").read_text()

    line = one_line_error(export(f"path={run}", f"out={hf}", "dtype=fp32", cwd=tmp_path))
    assert "exists: pass overwrite=true" in line, line
    again = export(f"path={run}", f"out={hf}", "dtype=fp32", "overwrite=true", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert '"torch_dtype": "float32"' in (hf / "config.json").read_text()
    assert (hf / MARKER).is_file() and (hf / "tokenizer").is_dir()
    assert leftovers(tmp_path, "hf") == []


def test_a_swapped_tokenizer_leaves_no_output_and_the_rerun_works(run, data, tmp_path):
    """The refusal left config.json and model.safetensors behind, and the rerun then said the
    directory exists."""
    from data.bpe import train_bpe
    from tests.data.helpers import write_corpus

    texts = [p.read_text() for p in write_corpus(tmp_path / "corpus", files=5, seed=3)]
    tokenizer, kept = data / "tokenizer", tmp_path / "kept_tokenizer"
    tokenizer.rename(kept)
    try:
        train_bpe(texts, 280, name="other").save(tokenizer)
        hf = tmp_path / "out" / "hf"
        line = one_line_error(export(f"path={run}", f"out={hf}", cwd=tmp_path))
        assert "the folder was replaced" in line, line
        assert not hf.exists() and leftovers(hf.parent, "hf") == []
    finally:
        shutil.rmtree(tokenizer, ignore_errors=True)
        kept.rename(tokenizer)
    rerun = export(f"path={run}", f"out={hf}", cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert (hf / "config.json").is_file()


def test_non_finite_weights_are_refused_unless_allowed(data, tmp_path):
    """A checkpoint whose weights hold NaN and inf (a diverged run's last save) was exported."""
    run_dir = tmp_path / "diverged"
    training = build_training(small_config(data, max_steps=2), run_dir, ONE)
    weight = dict(training.model.named_parameters())[POISONED]
    with torch.no_grad():
        weight.view(-1)[:3] = float("nan")
        weight.view(-1)[3:5] = float("inf")
    training.checkpointer.save(0, training.engine, training.extra_state())
    training.checkpointer.wait()
    del training

    hf = tmp_path / "hf"
    line = one_line_error(export(f"path={run_dir}", f"out={hf}", cwd=tmp_path))
    assert f"{POISONED} has 5 NaN or infinite values" in line, line
    assert "allow_nonfinite=true" in line
    assert not hf.exists() and leftovers(tmp_path, "hf") == []  # layer 0 was written, then removed

    allowed = export(f"path={run_dir}", f"out={hf}", "allow_nonfinite=true", cwd=tmp_path)
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert (hf / "model.safetensors").is_file()


@pytest.mark.parametrize("size", ["nan", "inf"])
def test_a_nonsense_shard_size_is_one_line(tmp_path, size):
    """nan and inf were tracebacks (int() of them)."""
    line = one_line_error(export("path=run", "out=hf", f"max_shard_size={size}", cwd=tmp_path))
    assert f"max_shard_size='{size}' is not a size like 5GB" in line, line


@pytest.mark.parametrize("size", ["nan", "inf", "-inf", "infGB", "-1GB", "0", "0.5", "abc"])
def test_every_shard_size_that_is_not_one_is_a_settings_error(size):
    from model.errors import ConfigError
    from trainer.export import ExportConfig

    with pytest.raises(ConfigError, match="is not a size like 5GB"):
        ExportConfig(path="run", out="hf", max_shard_size=size)


def _export_on_tmpfs(
    run: Path, tmp_path: Path, options: str
) -> tuple[subprocess.CompletedProcess, str]:
    """The export into a tmpfs mounted with `options` at tmp_path/disk (in a user namespace);
    (the result, what the disk holds afterwards, listed before the mount goes away)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    command = (
        f"{sys.executable} -m trainer.export 'path={run}' 'out={disk / 'hf'}'; "
        f"rc=$?; ls -A {disk}; exit $rc"
    )
    result = run_on_tmpfs(disk, options, command, cwd=tmp_path, timeout=300)
    return result, result.stdout.strip()


@needs_tmpfs
def test_a_read_only_output_is_one_line(run, tmp_path):
    result, left = _export_on_tmpfs(run, tmp_path, "ro")
    line = one_line_error(result)
    assert "Read-only file system" in line and "choose an out= you can write" in line, line
    assert left == ""


@needs_tmpfs
def test_a_full_disk_is_one_line_and_leaves_nothing(run, tmp_path):
    """The export (about 250 kB of weights) on a 64 KiB tmpfs."""
    result, left = _export_on_tmpfs(run, tmp_path, "size=64k")
    line = one_line_error(result)
    assert "no space left on the device of" in line and "free space" in line, line
    assert left == ""


def test_help_lists_the_settings_of_export_only(tmp_path):
    """conf/ also holds the trainer's groups; `trainer.export --help` does not list them."""
    result = run_module("trainer.export", "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "allow_nonfinite: false" in result.stdout and "max_shard_size: 5GB" in result.stdout
    for trainer_only in ("Configuration groups", "optim", "llama3_8b", "parallel"):
        assert trainer_only not in result.stdout
    assert not list(tmp_path.iterdir())  # help writes nothing
