"""Shared fixtures of the data tests: a small deterministic corpus and a BPE trained on it."""

from __future__ import annotations

from pathlib import Path

import pytest

from data.bpe import train_bpe
from tests.data.helpers import write_corpus


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("corpus")
    write_corpus(directory)
    return directory


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, corpus_dir: Path) -> Path:
    """A 512-token BPE trained on the corpus (uint16 shards)."""
    texts = [p.read_text(encoding="utf-8") for p in sorted(corpus_dir.iterdir())]
    return train_bpe(texts, 512, name="test-bpe").save(tmp_path_factory.mktemp("tokenizer"))
