"""README.md's recipes, run for real in the order a newcomer follows them: prepare their text,
train, resume, export to Hugging Face, prepare data with the export's tokenizer and continue
pretraining from it (small model, a few steps appended). Recipes that need GPUs, a cluster or
hours (torchrun, sbatch, the big presets) are composed and validated by tests/test_docs.py.
`$HOME` in the commands is the test's directory, as the shell would expand it.
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
from tests.docs_pages import pages, table_commands
from tests.trainer.helpers import SMALL_OVERRIDES

pytestmark = pytest.mark.integration

README = ROOT / "README.md"
OUTPUT_KEYS = ("out", "data.path", "hydra.run.dir")  # where the recipes write
# the recipes keep their model.vocab_size; the rest is made small and short
TRAIN_OVERRIDES = [o for o in SMALL_OVERRIDES if not o.startswith("model.vocab_size=")] + [
    "trainer.micro_batch_size=0",
    "logging.wandb=disabled",
]
RUN_FOR_REAL = ("data.prepare", "trainer", "trainer.export", "trainer.eval")


def setting(argv: list[str] | tuple[str, ...], key: str) -> str | None:
    found = [a.split("=", 1)[1] for a in argv if a.startswith(f"{key}=")]
    return found[-1] if found else None


def recipes(home: Path) -> list[list[str]]:
    """README's recipe commands as argv, `$HOME` expanded."""
    return [
        [a.replace("$HOME", str(home)) for a in command.argv] for command in table_commands(README)
    ]


def runs_for_real(argv: list[str]) -> bool:
    """One process, and its data named (the default corpus is the other tests' business)."""
    if argv[:2] != ["python", "-m"] or argv[2] not in RUN_FOR_REAL or "--cfg" in argv:
        return False
    return argv[2] != "trainer" or any(a.startswith(("data.path=", "init_from=")) for a in argv)


def ignored_top_folders() -> set[str]:
    lines = (ROOT / ".gitignore").read_text().splitlines()
    return {line.strip("/") for line in lines if line.endswith("/") and "*" not in line}


def test_the_recipes_write_outside_the_checkout_or_into_ignored_folders():
    ignored = ignored_top_folders()
    checked = 0
    for argv in recipes(Path("/home/user")):
        for key in OUTPUT_KEYS:
            value = setting(argv, key)
            if value is None or value.startswith(("~", "/")):
                continue
            checked += 1
            top = Path(value).parts[0]
            assert top in ignored, f"{' '.join(argv)}: {key}={value} lands in the checkout"
    assert checked >= 3  # runs/exp1, its export, runs/exp2


def random_word_corpus(directory: Path) -> Path:
    """About 240 KB of random words: enough distinct pairs for the recipe's 32768-id BPE."""
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


def test_the_readme_recipes_run_in_order(tmp_path: Path):
    """Each recipe that runs in one process on its own data runs, in the README's order, and
    each leaves what the next one reads: the dataset, the run and its checkpoint, the export."""
    random_word_corpus(tmp_path / "corpus")
    env = {"HOME": str(tmp_path)}
    real = [argv for argv in recipes(tmp_path) if runs_for_real(argv)]
    assert [a[2] for a in real] == [
        "data.prepare", "trainer", "trainer", "trainer.export", "data.prepare", "trainer",
        "trainer.eval",
    ], "the README's recipe chain changed: update this test with it"  # fmt: skip
    steps_in: dict[str, int] = {}
    for argv in real:
        extra = ["progress=false"] if argv[2] == "data.prepare" else []
        if argv[2] == "trainer.eval":  # a few questions of each task
            argv = [a for a in argv if not a.startswith("limit=")] + ["limit=3"]
        if argv[2] == "trainer":
            run_dir = setting(argv, "hydra.run.dir")
            steps_in[run_dir] = steps_in.get(run_dir, 0) + 2  # a resume trains 2 steps more
            extra = [*TRAIN_OVERRIDES, f"trainer.max_steps={steps_in[run_dir]}"]
        done = run_module(argv[2], *argv[3:], *extra, cwd=tmp_path, env=env)
        assert done.returncode == 0, f"{shlex.join(argv)}:\n{done.stderr[-3000:]}"
        if argv[2] == "trainer":
            steps = steps_in[run_dir]
            ended = rf"done: (?:{steps} steps|step {steps} \(2 steps from step {steps - 2})"
            assert re.search(ended, done.stderr), done.stderr[-2000:]
    prepared = json.loads((tmp_path / "lmforge-data" / "mine" / "manifest.json").read_text())
    assert prepared["tokenizer"]["vocab_size"] == 32768
    resumed = (tmp_path / "runs" / "exp1" / "train.log").read_text()
    assert re.search(r"resumed from \S+step_0+2 at step 2", resumed), (
        "the second run did not resume"
    )
    assert (tmp_path / "runs" / "exp1-hf" / "config.json").is_file()
    continued = (tmp_path / "runs" / "exp2" / "train.log").read_text()
    assert "exp1-hf" in continued
    # the start says where the weights came from, not "from scratch"
    assert "starting a new run from init_from=hf:" in continued and "from scratch" not in continued
    assert "optimizer: adamw, lr 0.003" in continued
    (scores,) = tmp_path.glob("eval_exp1_step*.json")  # trainer.eval's table, as JSON
    assert set(json.loads(scores.read_text())["tasks"]) == {"hellaswag", "arc_easy", "piqa"}


def quoted_path_example() -> str:
    """The docs' example of a quoted path, as the shell hands it over: data.path='...'."""
    text = "\n".join(page.read_text(encoding="utf-8") for page in pages())
    found = re.search(r"`(data\.path=\"'[^`]+'\")`", text)
    assert found, "no page shows a quoted data.path"
    (arg,) = shlex.split(found[1])
    return arg


def test_the_documented_quoting_takes_a_path_with_spaces_and_unicode(tmp_path: Path):
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
