"""The README's own commands, run as written (small corpus, small model, few steps appended).

Command lines are read from README.md, so an example that drifts from what works fails here.
`$HOME` in them becomes the test's directory, as the shell would expand it.
"""

from __future__ import annotations

import json
import random
import re
import shlex
from pathlib import Path

import pytest

from tests.commands import ROOT, run_module
from tests.data.helpers import write_corpus
from tests.trainer.helpers import SMALL_OVERRIDES

pytestmark = pytest.mark.integration

README = ROOT / "README.md"
OUTPUT_KEYS = ("out", "data.path", "hydra.run.dir")  # where the README's examples write
# the README's train commands keep their model.vocab_size; the rest is made small and short
TRAIN_OVERRIDES = [o for o in SMALL_OVERRIDES if not o.startswith("model.vocab_size=")] + [
    "trainer.max_steps=2",
    "trainer.micro_batch_size=0",
    "logging.wandb=disabled",
]


def commands(home: Path | None = None) -> list[list[str]]:
    """Every `python -m` / `torchrun` line of the README as argv (continuations joined, comments
    dropped, `$HOME` replaced by `home`), in order."""
    text = README.read_text(encoding="utf-8").replace("\\\n", " ")
    if home is not None:
        text = text.replace("$HOME", str(home))
    lines = [line.strip() for line in text.splitlines()]
    return [
        shlex.split(line, comments=True)
        for line in lines
        if line.startswith(("python -m ", "torchrun "))
    ]


def setting(argv: list[str], key: str) -> str | None:
    found = [a.split("=", 1)[1] for a in argv if a.startswith(f"{key}=")]
    return found[-1] if found else None


def ignored_top_folders() -> set[str]:
    lines = (ROOT / ".gitignore").read_text().splitlines()
    return {line.strip("/") for line in lines if line.endswith("/") and "*" not in line}


def test_the_examples_write_outside_the_package_folders_or_into_ignored_ones():
    ignored = ignored_top_folders()
    checked = 0
    for argv in commands():
        for key in OUTPUT_KEYS:
            value = setting(argv, key)
            if value is None or value.startswith(("~", "/", "$HOME")):
                continue
            checked += 1
            top = Path(value).parts[0]
            assert top in ignored, f"{' '.join(argv)}: {key}={value} lands in the checkout"
    assert checked >= 2  # runs/exp1 and its export


def random_word_corpus(directory: Path) -> Path:
    """About 240 KB of random words: enough distinct pairs for 32768 ids, so the trained
    vocabulary is the README's, larger than the default `tiny` model's 8192."""
    rng = random.Random(0)
    directory.mkdir()
    for f in range(20):
        paragraphs = [
            " ".join(
                "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
                for _ in range(60)
            )
            for _ in range(30)
        ]
        (directory / f"doc_{f:02d}.txt").write_text("\n\n".join(paragraphs) + "\n")
    return directory


def readme_pair(home: Path) -> tuple[list[str], list[str]]:
    """The Data section's `vocab_size=32768` preparation and the train command right after it."""
    lines = commands(home)
    i = next(
        i
        for i, argv in enumerate(lines)
        if argv[:3] == ["python", "-m", "data.prepare"] and "vocab_size=32768" in argv
    )
    return lines[i], lines[i + 1]


def test_the_documented_prepare_then_train_pair_works(tmp_path):
    prepare, train = readme_pair(tmp_path)
    assert train[:3] == ["python", "-m", "trainer"], "no train command follows the preparation"
    assert setting(train, "data.path") == setting(prepare, "out")
    corpus = random_word_corpus(tmp_path / "corpus")
    env = {"HOME": str(tmp_path)}
    prepare_args = [a if not a.startswith("source=") else f"source={corpus}" for a in prepare[3:]]
    done = run_module("data.prepare", *prepare_args, "progress=false", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    dataset = Path(setting(prepare, "out"))
    assert dataset.is_relative_to(tmp_path)
    manifest = json.loads((dataset / "manifest.json").read_text())
    assert manifest["tokenizer"]["vocab_size"] == 32768
    # the train command after it, and the Training section's (qwen3_0_6b) on the same data
    trains = [
        a
        for a in commands(tmp_path)
        if a[:3] == train[:3] and setting(a, "data.path") == str(dataset)
    ]
    assert train in trains and len(trains) == 2
    for argv in trains:
        trained = run_module("trainer", *argv[3:], *TRAIN_OVERRIDES, cwd=tmp_path, env=env)
        assert trained.returncode == 0, f"{' '.join(argv)}: {trained.stderr[-3000:]}"
        assert "done: 2 steps" in trained.stderr


def quoted_path_example() -> str:
    """The README's example of a quoted path, as the shell hands it over: data.path='...'."""
    found = re.search(r"`(data\.path=\"'[^`]+'\")`", README.read_text(encoding="utf-8"))
    assert found, "README shows no quoted data.path"
    (arg,) = shlex.split(found[1])
    return arg


def test_the_documented_quoting_takes_a_path_with_spaces_and_unicode(tmp_path):
    data_path = quoted_path_example()
    corpus_dir = write_corpus(tmp_path / "corpus")[0].parent
    assert " " in data_path and not data_path.isascii()
    env = {"HOME": str(tmp_path)}
    out = "out=" + data_path.split("=", 1)[1]
    args = [f"source={corpus_dir}", out, "vocab_size=300", "val_fraction=0.2", "progress=false"]
    done = run_module("data.prepare", *args, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    dataset = tmp_path / data_path.split("=", 1)[1].strip("'").removeprefix("~/")
    assert (dataset / "manifest.json").is_file()
    steps = "trainer.max_steps=1"
    trained = run_module("trainer", data_path, *SMALL_OVERRIDES, steps, cwd=tmp_path, env=env)
    assert trained.returncode == 0, trained.stderr[-3000:]
