"""The tokenizer a checkpoint was trained with: the training data's `tokenizer/` folder that its
trainer state names (`tokenizer_dir`), verified against the identity it records (`tokenizer`;
older checkpoints: the dataset manifest's). What export copies and what scoring encodes with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from data.errors import DataError
from data.manifest import Manifest
from data.tokenizer import Tokenizer, TokenizerIdentity, load_verified_tokenizer


class TokenizerGone(DataError):
    """The checkpoint names no tokenizer, or the folder it names is no longer there."""


def tokenizer_dir(extra: dict[str, Any]) -> Path:
    """The folder the checkpoint's trainer state names (TokenizerGone when none or missing)."""
    if not extra.get("tokenizer_dir"):
        raise TokenizerGone("the checkpoint names no tokenizer")
    directory = Path(extra["tokenizer_dir"])
    if not directory.is_dir():
        raise TokenizerGone(f"the checkpoint's tokenizer {directory} is not there any more")
    return directory


def checkpoint_tokenizer(extra: dict[str, Any]) -> Tokenizer:
    """The checkpoint's tokenizer, verified to be the one it was trained with: TokenizerGone
    when the checkpoint names none or its folder is gone; DataError when the folder was
    replaced by another tokenizer."""
    directory = tokenizer_dir(extra)
    if "tokenizer" in extra:
        expected = TokenizerIdentity.from_dict(extra["tokenizer"])
    else:  # older checkpoints: the dataset's manifest says which tokenizer it was
        expected = Manifest.load(directory.parent).tokenizer
    return load_verified_tokenizer(directory, expected, "the checkpoint")
