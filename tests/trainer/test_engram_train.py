"""Engram through the trainer: the token compression is built from the data's tokenizer, saved in
the run directory and in checkpoints; the tables train (row-wise) and the validation loss falls;
an interrupted run resumes to the same losses, bitwise; a run whose compression changed is refused."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from data.errors import DataError
from data.token_compression import canonical_ids
from data.tokenizer import load_tokenizer
from model.presets import load_preset
from tests.trainer.helpers import SMALL_MODEL, metric_rows, small_config
from trainer.app import build_training
from trainer.runtime import Ranks

ONE = Ranks(rank=0, world_size=1, local_rank=0)
SMALL = SMALL_MODEL | {
    "n_layers": 3,
    "ffn.hidden": 96,
    "engram.layers": [1],
    "engram.heads": 2,
    "engram.dim": 32,
    "engram.table_sizes": [1009, 1013],
}


def engram_config(dataset, steps: int):
    cfg = small_config(dataset, max_steps=steps, eval_every=steps // 2)
    cfg.model = load_preset("tiny_engram", SMALL)
    cfg.trainer.precision = "fp32"
    cfg.checkpoint.every = steps // 2
    return cfg


def test_engram_trains_saves_its_compression_and_resumes_bitwise(dataset, tmp_path):
    training = build_training(engram_config(dataset, 20), tmp_path / "whole", ONE)
    table = training.engine.model.layers["1"].engram.table.weight
    initial = table.detach().clone()
    assert training.run() == 0
    saved = json.loads((tmp_path / "whole" / "token_compression.json").read_text())
    tokenizer = load_tokenizer(dataset / "tokenizer")
    vocab = training.model_cfg.vocab_size
    assert saved["canonical_ids"] == canonical_ids(tokenizer, vocab)
    assert saved["canonical_vocab"] < tokenizer.vocab_size  # the map folds some tokens
    compressed = training.engine.model.memory_ids.canonical
    assert compressed.tolist() == saved["canonical_ids"]
    assert not torch.equal(table, initial)
    rows = metric_rows(tmp_path / "whole")
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert val[-1] < val[0] - 0.5
    first = build_training(engram_config(dataset, 20), tmp_path / "split", ONE)
    first.loop = dataclasses.replace(first.loop, max_steps=10)
    assert first.run() == 0
    again = build_training(engram_config(dataset, 20), tmp_path / "split", ONE)
    assert again.step == 10 and again.run() == 0
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    resumed = {r["step"]: r["loss"] for r in metric_rows(tmp_path / "split") if "loss" in r}
    assert resumed == losses


def test_a_run_whose_compression_changed_is_refused(dataset, tmp_path):
    path = tmp_path / "run" / "token_compression.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"tokenizer": {"name": "other"}, "canonical_ids": [0, 1]}))
    with pytest.raises(DataError, match="another token compression"):
        build_training(engram_config(dataset, 4), tmp_path / "run", ONE)


def test_a_refused_start_writes_no_compression_and_the_right_one_then_starts(dataset, tmp_path):
    """Resuming another run's checkpoint on data of another tokenizer is refused (the model's
    vocabulary differs); nothing is recorded in the run directory, so the command with the
    right data then starts."""
    from tests.trainer.helpers import make_dataset
    from trainer.checkpoint.errors import CheckpointConflict

    source = build_training(engram_config(dataset, 2), tmp_path / "source", ONE)
    assert source.run() == 0
    checkpoint = tmp_path / "source" / "checkpoints" / "step_00000002"
    other = make_dataset(tmp_path / "other", vocab_size=400)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    wrong = engram_config(other, 4)
    wrong.resume = str(checkpoint)
    with pytest.raises(CheckpointConflict, match="other settings"):
        build_training(wrong, run_dir, ONE)
    assert not (run_dir / "token_compression.json").exists()
    right = engram_config(dataset, 4)
    right.resume = str(checkpoint)
    assert build_training(right, run_dir, ONE).step == 2
    assert (run_dir / "token_compression.json").is_file()
