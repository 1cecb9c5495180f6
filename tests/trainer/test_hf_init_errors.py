"""`init_from=hf:<dir>` with a damaged or inconsistent Hugging Face directory: a truncated
safetensors file, config.json keys missing or malformed (or no JSON at all), a truncated
tokenizer.json, a head count the weights do not have, a shard index naming a file outside the
directory. Each ends in one line naming the file and the problem, exit 2, no traceback, and no
run directory left behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from data.prepare import prepare
from tests.data.helpers import prepare_config, write_corpus
from tests.trainer.helpers import run_trainer

transformers = pytest.importorskip("transformers")
from tests.trainer.test_hf_init import COMMON, hf_llama  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_init_errors")
    hf_llama(root / "hf")
    corpus = write_corpus(root / "corpus")[0].parent
    prepare(prepare_config(corpus, root / "data", f"hf:{root / 'hf'}", val_fraction=0.2))
    return root


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def edit_config(directory: Path, change) -> None:
    config = json.loads((directory / "config.json").read_text())
    change(config)
    (directory / "config.json").write_text(json.dumps(config))


def shard_outside(directory: Path, target: str) -> None:
    """The weights moved out of the directory, named by an index as `target` (../x or absolute)."""
    outside = directory.parent / "outside.safetensors"
    (directory / "model.safetensors").rename(outside)
    from safetensors import safe_open

    with safe_open(outside, "pt") as f:
        names = list(f.keys())
    name = str(outside) if target == "absolute" else "../outside.safetensors"
    index = {"metadata": {}, "weight_map": dict.fromkeys(names, name)}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


CASES = {
    "truncated_weights": (lambda d: truncate(d / "model.safetensors"), ["model.safetensors"]),
    "missing_key": (
        lambda d: edit_config(d, lambda c: c.pop("hidden_size")),
        ["config.json", "hidden_size"],
    ),
    "malformed_key": (
        lambda d: edit_config(d, lambda c: c.update(num_hidden_layers="two")),
        ["config.json", "num_hidden_layers"],
    ),
    "config_not_json": (
        lambda d: (d / "config.json").write_text('{"model_type": "llama", '),
        ["config.json", "JSON"],
    ),
    "truncated_tokenizer": (lambda d: truncate(d / "tokenizer.json"), ["tokenizer.json"]),
    "head_count": (
        lambda d: edit_config(d, lambda c: c.update(num_attention_heads=8)),
        ["model.safetensors", "q_proj", "(64, 64)", "(128, 64)", "num_attention_heads"],
    ),
    "index_parent": (lambda d: shard_outside(d, "parent"), [".index.json", "outside"]),
    "index_absolute": (lambda d: shard_outside(d, "absolute"), [".index.json", "outside"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_broken_checkpoint_is_one_line_with_exit_2(checkpoint, tmp_path, case):
    damage, words = CASES[case]
    hf = tmp_path / "ckpt" / "hf"
    shutil.copytree(checkpoint / "hf", hf)
    damage(hf)
    run = tmp_path / "run"
    result = run_trainer(
        *COMMON, f"data.path={checkpoint / 'data'}", f"init_from=hf:{hf}", "trainer.max_steps=1",
        f"hydra.run.dir={run}", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    problem = [line for line in result.stderr.splitlines() if f"init_from=hf:{hf}" in line]
    assert len(problem) == 1, result.stderr[-3000:]
    for word in words:
        assert word in problem[0], (word, problem[0])
    assert not run.exists()


def check_on_rank(rank: int, directories: list[str], data: str) -> str:
    """hf_model_config on directories[rank]; the ConfigError it raises ("" if none)."""
    from data.manifest import Manifest
    from model.errors import ConfigError
    from trainer.hf_init import hf_model_config

    try:
        hf_model_config(f"hf:{directories[rank]}", Manifest.load(Path(data)), [])
    except ConfigError as err:
        return str(err)
    return ""


@pytest.mark.distributed
def test_a_mismatch_seen_by_one_rank_stops_every_rank(checkpoint, tmp_path):
    """Rank 1's copy has another head count (a node's stale copy): it names the problem, and
    rank 0, whose copy fits, refuses too, with rank 1's words (its log is the one users read),
    instead of building an engine the other never joins."""
    from tests.parallel.ranks import run_ranks

    shutil.copytree(checkpoint / "hf", tmp_path / "copy")
    edit_config(tmp_path / "copy", lambda c: c.update(num_attention_heads=8))
    directories = [str(checkpoint / "hf"), str(tmp_path / "copy")]
    errors = run_ranks(2, check_on_rank, directories, str(checkpoint / "data"))
    assert errors[0] == errors[1]
    assert errors[1].startswith(f"init_from=hf:{tmp_path / 'copy'}: ")
    assert "q_proj" in errors[1]
