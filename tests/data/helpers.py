"""Helpers of the data tests: a deterministic multilingual corpus and small prepare settings."""

from __future__ import annotations

import random
from pathlib import Path

from data.config import PrepareConfig

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "with",
    "was",
    "on",
    "be",
    "by",
    "this",
    "are",
    "from",
    "at",
    "or",
    "an",
    "naïve",
    "café",
    "résumé",
    "東京",
    "数据",
    "модель",
    "Ελληνικά",
    "🙂",
    "🚀",
    "def",
    "return",
    "class",
    "import",
    "self",
    "None",
]


def pseudo_word(rng: random.Random) -> str:
    return "".join(rng.choice("aeioubcdfghklmnprstvwzéüñ") for _ in range(rng.randint(2, 8)))


def make_text(rng: random.Random, words: int) -> str:
    lines, line = [], []
    for _ in range(words):
        line.append(rng.choice(WORDS) if rng.random() < 0.7 else pseudo_word(rng))
        if rng.random() < 0.12:
            lines.append(" ".join(line))
            line = []
    lines.append(" ".join(line))
    return "\n".join(lines) + "\n"


def write_corpus(directory: Path, files: int = 40, seed: int = 0) -> list[Path]:
    """`files` text files of 20-400 words each, named so that sorted order = creation order."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(files):
        path = directory / f"doc_{i:03d}.txt"
        path.write_text(make_text(rng, rng.randint(20, 400)), encoding="utf-8")
        paths.append(path)
    return paths


def prepare_config(source: Path | str, out: Path, tokenizer: Path | str, **kw) -> PrepareConfig:
    """Small shards so that documents cross shard boundaries; one in-process worker."""
    settings = dict(shard_tokens=997, val_fraction=0.1, workers=1, progress=False)
    settings.update(kw)
    return PrepareConfig(source=str(source), out=str(out), tokenizer=str(tokenizer), **settings)
