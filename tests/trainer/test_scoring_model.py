"""trainer.scoring_model.load_scoring_model: a run directory, a checkpoint directory and a Hugging
Face export all give the trained model (the same logits: fp32 export, rel 1e-5), the tokenizer it
was trained with, the length it was trained at and its step; what a user gets wrong is one line
naming the fix."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from data.errors import DataError
from data.manifest import Manifest
from model.errors import ConfigError
from tests.trainer.scoring_helpers import train_and_export
from trainer.scoring_model import load_scoring_model


@pytest.fixture(scope="module")
def data(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the dataset: one test moves its tokenizer away (and back)."""
    copy = tmp_path_factory.mktemp("scoring_data") / "dataset"
    shutil.copytree(dataset, copy)
    return copy


@pytest.fixture(scope="module")
def trained(data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return train_and_export(data, tmp_path_factory.mktemp("scoring_run"))


TOKENS = torch.tensor([[5, 17, 3, 99, 250, 7, 7, 1]])


def logits(scoring) -> torch.Tensor:
    with torch.no_grad():
        return scoring.model(TOKENS)


def test_a_run_directory_gives_its_newest_checkpoint(trained, data):
    run, _ = trained
    scoring = load_scoring_model(run)
    assert scoring.source == str(run / "checkpoints" / "step_00000002")
    assert scoring.step == 2
    assert scoring.max_seq_len == 32  # data.seq_len of the run, not model.max_seq_len
    assert scoring.model.cfg.max_seq_len == 64
    assert scoring.tokenizer.identity.hash == Manifest.load(data).tokenizer.hash
    assert not scoring.model.training
    assert all(not p.requires_grad for p in scoring.model.parameters())


def test_a_checkpoint_directory_and_the_export_hold_the_same_model(trained, data):
    run, hf = trained
    from_run = load_scoring_model(run)
    from_ckpt = load_scoring_model(run / "checkpoints" / "step_00000002")
    from_hf = load_scoring_model(hf)
    assert from_ckpt.source == from_run.source and from_ckpt.step == 2
    assert from_hf.source == str(hf) and from_hf.step == 2  # the export's record
    assert from_hf.max_seq_len == 64  # an export records no run config: the model's length
    assert from_hf.tokenizer.identity.hash == Manifest.load(data).tokenizer.hash
    torch.testing.assert_close(logits(from_ckpt), logits(from_run), rtol=0, atol=0)
    torch.testing.assert_close(logits(from_hf), logits(from_run), rtol=1e-5, atol=1e-5)


def test_an_export_without_its_tokenizer_folder_uses_its_tokenizer_json(trained, tmp_path):
    _, hf = trained
    copy = tmp_path / "hf"
    shutil.copytree(hf, copy)
    shutil.rmtree(copy / "tokenizer")
    scoring = load_scoring_model(copy)
    assert scoring.tokenizer.identity.hash == load_scoring_model(hf).tokenizer.identity.hash


def test_dtype_and_device_are_applied(trained):
    scoring = load_scoring_model(trained[0], device="cpu", dtype="bf16")
    assert scoring.model.head_weight.dtype == torch.bfloat16
    assert scoring.model.head_weight.device.type == "cpu"


def one_line(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


def test_a_path_that_does_not_exist_is_one_line(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_scoring_model(tmp_path / "nope")
    text = one_line(err)
    assert "does not exist" in text and "run directory" in text


def test_a_directory_that_holds_no_model_is_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ConfigError) as err:
        load_scoring_model(tmp_path)
    text = one_line(err)
    assert f"path={tmp_path} is not" in text and "Hugging Face directory" in text


def test_a_bad_dtype_is_one_line(trained):
    with pytest.raises(ConfigError, match="dtype=fp8 is not one of"):
        load_scoring_model(trained[0], dtype="fp8")


def test_a_checkpoint_whose_tokenizer_is_gone_names_the_fix(trained, data, tmp_path):
    run, _ = trained
    moved = tmp_path / "tokenizer"
    shutil.move(data / "tokenizer", moved)
    try:
        with pytest.raises(DataError) as err:
            load_scoring_model(run)
        text = one_line(err)
        assert "is not there any more" in text and "tokenizer=<a copy of it>" in text
        # the fix works: the moved folder, verified against the checkpoint's record
        scoring = load_scoring_model(run, tokenizer=str(moved))
        assert scoring.tokenizer.identity.hash == Manifest.load(data).tokenizer.hash
    finally:
        shutil.move(moved, data / "tokenizer")


def test_another_tokenizer_than_the_checkpoints_is_refused(trained, tmp_path):
    other = tmp_path / "other.tiktoken"
    other.write_bytes(b"YQ== 0\nYg== 1\n")  # a two-token tokenizer
    with pytest.raises(DataError) as err:
        load_scoring_model(trained[0], tokenizer=str(other))
    assert "was trained with" in one_line(err)
