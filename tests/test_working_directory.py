"""Every command works from a directory holding `data/`, `model/`, `trainer/`, ... folders (the
README's own `out=data/...` makes one): the installed packages win over the working directory's
folders under `python -m`, also in spawned worker processes (issue 13, item 12).

Runs the installed project (no PYTHONPATH), as users do after `pip install -e .`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.commands import OFFLINE, ROOT
from tests.data.helpers import write_corpus
from tests.trainer.helpers import SMALL_OVERRIDES

pytestmark = pytest.mark.integration
SHADOWS = ("data", "model", "trainer", "optim", "parallel", "launch")


def installed_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return env | OFFLINE | {"OMP_NUM_THREADS": "1"}


def run(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=installed_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture
def shadowed(tmp_path: Path) -> Path:
    """A working directory with a folder of every package's name (holding a file, no code)."""
    probe = subprocess.run(
        [sys.executable, "-c", "import trainer; print(trainer.__file__)"],
        cwd="/",
        env=installed_env(),
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0 or not probe.stdout.startswith(str(ROOT)):
        pytest.skip("the project is not installed from this checkout (pip install -e .)")
    for name in SHADOWS:
        (tmp_path / name).mkdir()
        (tmp_path / name / "notes.txt").write_text("not code\n")
    return tmp_path


def test_every_command_runs_from_a_directory_with_package_named_folders(shadowed: Path):
    corpus = write_corpus(shadowed / "data" / "corpus")[0].parent
    dataset = shadowed / "data" / "prepared"
    prepare = run(
        "data.prepare",
        f"source={corpus}",
        f"out={dataset}",
        "vocab_size=300",
        "val_fraction=0.2",
        "workers=2",  # spawned tokenizer processes import the packages too
        "progress=false",
        cwd=shadowed,
    )
    assert prepare.returncode == 0, prepare.stderr[-3000:]
    run_dir = shadowed / "runs" / "one"
    args = [f"data.path={dataset}", *SMALL_OVERRIDES, "trainer.max_steps=2"]
    trained = run("trainer", *args, f"hydra.run.dir={run_dir}", "data.num_workers=1", cwd=shadowed)
    assert trained.returncode == 0, trained.stderr[-3000:]
    exported = run("trainer.export", f"path={run_dir}", f"out={shadowed / 'hf'}", cwd=shadowed)
    assert exported.returncode == 0, exported.stderr[-3000:]
    inspected = run("model.inspect", "model=tiny", cwd=shadowed)
    assert inspected.returncode == 0 and "attention" in inspected.stdout, inspected.stderr
    launched = run(
        "launch.torchrun",
        "--nproc-per-node=1",
        *args,
        f"hydra.run.dir={shadowed / 'runs' / 'two'}",
        cwd=shadowed,
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    for result in (prepare, trained, exported, inspected, launched):
        assert "Traceback" not in result.stderr
