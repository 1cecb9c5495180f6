"""Datasets that were tampered with or damaged, and preparation inputs that used to give
tracebacks or silent surprises (issue 13, items 10, 11, 19, 20)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from data.config import LoaderConfig
from data.errors import DataError
from data.loader import TokenLoader
from data.manifest import Manifest
from data.prepare import prepare
from data.tokenizer import load_tokenizer
from tests.data.helpers import prepare_config
from tests.data.test_prepare_cli import run_prepare


@pytest.fixture
def dataset(tmp_path, corpus_dir, tokenizer_dir) -> Path:
    out = tmp_path / "dataset"
    prepare(prepare_config(corpus_dir, out, tokenizer_dir, val_fraction=0.25))
    return out


def open_loader(path: Path, **kw) -> TokenLoader:
    cfg = LoaderConfig(path=str(path), seq_len=16, num_workers=0, val_batches=1, **kw)
    return TokenLoader(cfg, global_batch=4)


def edit_manifest(path: Path, edit) -> None:
    raw = json.loads((path / "manifest.json").read_text())
    edit(raw)
    (path / "manifest.json").write_text(json.dumps(raw))


@pytest.mark.parametrize("where", ["../../etc/group", "/etc/group", "train/../../../x.bin"])
def test_a_shard_path_outside_the_dataset_is_refused(dataset, where):
    edit_manifest(dataset, lambda raw: raw["splits"]["train"]["shards"][0].update(bin=where))
    with pytest.raises(DataError, match="lies outside the dataset directory: refused"):
        Manifest.load(dataset)


def test_a_tokenizer_path_outside_the_dataset_is_refused(dataset):
    edit_manifest(dataset, lambda raw: raw["tokenizer"].update(dir="../elsewhere"))
    with pytest.raises(DataError, match="outside the dataset directory"):
        Manifest.load(dataset)


def swap_tokenizer(dataset: Path, other: Path) -> None:
    shutil.rmtree(dataset / "tokenizer")
    shutil.copytree(other, dataset / "tokenizer")


@pytest.fixture
def other_tokenizer(corpus_dir, tmp_path) -> Path:
    from data.bpe import train_bpe

    texts = [p.read_text(encoding="utf-8") for p in sorted(corpus_dir.iterdir())]
    return train_bpe(texts, 400, name="other").save(tmp_path / "other_tokenizer")


def test_a_swapped_tokenizer_folder_is_refused_by_the_loader(dataset, other_tokenizer):
    swap_tokenizer(dataset, other_tokenizer)
    with pytest.raises(DataError, match="the folder was replaced"):
        _ = open_loader(dataset).tokenizer


def test_repair_with_a_swapped_tokenizer_refuses_to_reencode(
    dataset, other_tokenizer, corpus_dir, tokenizer_dir
):
    shard = dataset / "train" / "00001.bin"
    shard.write_bytes(b"\0" * shard.stat().st_size)  # damaged: a re-run would re-encode it
    swap_tokenizer(dataset, other_tokenizer)
    config = prepare_config(corpus_dir, dataset, tokenizer_dir, val_fraction=0.25)
    with pytest.raises(DataError, match="the folder was replaced"):
        prepare(config)
    swap_tokenizer(dataset, tokenizer_dir)  # the original back: the repair goes through
    assert prepare(config).tokenizer == load_tokenizer(tokenizer_dir).identity


def test_the_same_source_by_a_relative_path_is_the_same_setting(
    corpus_dir, tokenizer_dir, tmp_path, monkeypatch
):
    out = tmp_path / "dataset"
    prepare(prepare_config(corpus_dir, out, tokenizer_dir))
    monkeypatch.chdir(corpus_dir.parent)
    again = prepare(prepare_config(Path(corpus_dir.name), out, tokenizer_dir))
    assert again.tokens("train") > 0


def test_a_damaged_settings_file_is_named(dataset, corpus_dir, tokenizer_dir):
    (dataset / "prepare.json").write_text("{ not json")
    config = prepare_config(corpus_dir, dataset, tokenizer_dir, val_fraction=0.25)
    with pytest.raises(DataError, match=r"prepare.json is damaged .* delete"):
        prepare(config)


def test_out_under_a_file_and_a_damaged_settings_file_from_the_command_line(corpus_dir, tmp_path):
    (tmp_path / "a_file").write_text("x")
    result = run_prepare(
        f"source={corpus_dir}", f"out={tmp_path / 'a_file' / 'out'}", "progress=false", cwd=tmp_path
    )
    assert result.returncode == 1 and "cannot be created" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def corrupt(path: Path, at: int, value: int, dtype) -> None:
    data = np.fromfile(path, dtype=dtype)
    data[at] = value
    data.tofile(path)


def test_corrupt_shards_under_verify_size_are_named_not_an_index_error(dataset):
    manifest = Manifest.load(dataset)
    corrupt(dataset / "train" / "00000.bin", 3, manifest.vocab_size + 7, manifest.dtype)
    with pytest.raises(DataError, match=r"00000.bin is damaged \(it holds token ids outside"):
        next(iter(open_loader(dataset, verify="size", shuffle=False)))
    corrupt(dataset / "train" / "00000.bin", 3, 1, manifest.dtype)
    corrupt(dataset / "train" / "00000.idx", -1, 10**9, np.int64)  # an offset past the shard
    loader = open_loader(dataset, verify="size", shuffle=False)
    batches = iter(loader)
    with pytest.raises(DataError, match=r"00000.bin is damaged \(its document offsets"):
        for _ in range(loader.windows // 4):
            next(batches)


def test_more_validation_batches_than_the_split_holds_is_warned_about(dataset, caplog):
    caplog.set_level(logging.WARNING)
    cfg = LoaderConfig(path=str(dataset), seq_len=16, num_workers=0, val_batches=1000)
    loader = TokenLoader(cfg, global_batch=4)
    assert 0 < loader.val_batches < 1000
    assert f"data.val_batches=1000, but the validation split of {dataset} holds only" in caplog.text
