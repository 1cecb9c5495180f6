"""The dataset manifest (`manifest.json`) and the checksums it records.

Layout of a prepared dataset directory:

    manifest.json            written last: its presence means every shard below is complete
    prepare.json             the settings that produced the bytes (a re-run must match them)
    tokenizer/               tokenizer.tiktoken + tokenizer.json (the dataset is self-contained)
    train/00000.bin          tokens of the split's stream, back to back (uint16 or uint32)
    train/00000.idx          int64 offsets (within the shard) of the documents that start there
    train/00000.json         the shard's record; written after .bin and .idx, so it commits them
    val/...                  the held-out documents, the same way
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from data.errors import DataError
from data.tokenizer import TokenizerIdentity

FORMAT = "lmforge-shards/1"
MANIFEST = "manifest.json"
SPLITS = ("train", "val")
CHECKSUM = "xxh3_128"
INDEX_DTYPE = np.dtype(np.int64)


def _check_paths_inside(path: Path, splits: dict[str, list[ShardRecord]], tokenizer: str) -> None:
    """Every file the manifest names lies inside the dataset directory (no absolute paths, no
    `..`): a crafted manifest must not make the loader read other files."""
    named = [tokenizer] + [rel for recs in splits.values() for r in recs for rel in (r.bin, r.idx)]
    for rel in named:
        normal = os.path.normpath(str(rel))
        if os.path.isabs(normal) or normal == ".." or normal.startswith(".." + os.sep):
            raise DataError(
                f"{path} names {rel!r}, which lies outside the dataset directory: refused. A "
                f"manifest written by data.prepare only names files inside it; prepare it again"
            )


def file_checksum(path: Path, chunk: int = 1 << 23) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return f"{CHECKSUM}:{h.hexdigest()}"


@dataclass(frozen=True)
class ShardRecord:
    """One shard of a split: `bin` holds `tokens` tokens, `idx` holds `documents` offsets."""

    bin: str  # path relative to the dataset directory
    idx: str
    tokens: int
    documents: int
    checksum: str
    idx_checksum: str

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Manifest:
    root: Path
    tokenizer: TokenizerIdentity
    vocab_size: int
    eot_id: int
    dtype: np.dtype
    splits: dict[str, list[ShardRecord]]
    raw: dict[str, Any]  # everything else (source description, settings), as written

    def tokens(self, split: str) -> int:
        return sum(s.tokens for s in self.splits[split])

    def documents(self, split: str) -> int:
        return sum(s.documents for s in self.splits[split])

    @property
    def digest(self) -> str:
        """Names the exact shard contents (changes when any shard's bytes change)."""
        shards = [[s.checksum for s in self.splits[name]] for name in SPLITS]
        return hashlib.sha256(json.dumps(shards).encode()).hexdigest()[:16]

    @classmethod
    def load(cls, root: str | Path) -> Manifest:
        root = Path(root).expanduser()
        path = root / MANIFEST
        if not path.is_file():
            hint = (
                "its preparation has not finished: re-run the same `python -m data.prepare` "
                "command to complete it"
                if (root / "prepare.json").is_file()
                else "prepare one with `python -m data.prepare source=... out=" + str(root) + "`"
            )
            raise DataError(f"no {MANIFEST} in {root}: {hint}")
        try:
            raw = json.loads(path.read_text())
            if raw.get("format") != FORMAT:
                raise DataError(f"{path} has format {raw.get('format')!r}, expected {FORMAT!r}")
            splits = {
                name: [ShardRecord(**s) for s in raw["splits"][name]["shards"]] for name in SPLITS
            }
            tok = raw["tokenizer"]
            _check_paths_inside(path, splits, tok.get("dir", "tokenizer"))
            return cls(
                root=root,
                tokenizer=TokenizerIdentity.from_dict(tok),
                vocab_size=int(tok["vocab_size"]),
                eot_id=int(tok["eot_id"]),
                dtype=np.dtype(raw["dtype"]),
                splits=splits,
                raw=raw,
            )
        except (KeyError, TypeError, ValueError) as err:
            if isinstance(err, DataError):
                raise
            raise DataError(
                f"{path} is damaged ({type(err).__name__}: {err}); delete it and re-run "
                f"`python -m data.prepare` with the same arguments to rewrite it"
            ) from err

    @property
    def tokenizer_dir(self) -> Path:
        return self.root / self.raw["tokenizer"].get("dir", "tokenizer")

    def check_tokenizer(self, expected: TokenizerIdentity | None, who: str = "the model") -> None:
        """Stop when the shards were tokenized differently from what `who` was trained with."""
        if expected is not None and expected.hash != self.tokenizer.hash:
            raise DataError(
                f"{self.root} was tokenized with {self.tokenizer.short()}, but {who} uses "
                f"{expected.short()}: token ids would mean different text. Prepare the data with "
                f"that tokenizer (python -m data.prepare tokenizer=...) or start a new run"
            )
