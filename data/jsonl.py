"""JSON Lines files read line by line: a malformed line is one skipped row, not the end of the
file (datasets' json builder parses in blocks and loses everything after a bad line).

Compressed files (.gz, .bz2, .xz) are read through the standard library; each row keeps its
line number, so a problem names the exact line.
"""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

OPENERS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}


class Row:
    """Line `line` of a file: the parsed object, or `problem` saying why there is none."""

    __slots__ = ("line", "problem", "value")

    def __init__(self, line: int, value: Any = None, problem: str = ""):
        self.line, self.value, self.problem = line, value, problem


def readable(path: Path) -> bool:
    """Whether this reader handles `path` (.jsonl, optionally compressed by the stdlib)."""
    suffixes = path.suffixes
    if suffixes and suffixes[-1] in OPENERS:
        suffixes = suffixes[:-1]
    return bool(suffixes) and suffixes[-1] == ".jsonl"


def _open(path: Path) -> IO[bytes]:
    opener = OPENERS.get(path.suffix, open)
    return opener(path, "rb")  # type: ignore[operator]


def rows(path: Path, decode_errors: str) -> Iterator[Row]:
    """Every non-blank line as a Row; undecodable bytes follow `decode_errors` (strict raises
    UnicodeDecodeError, skip makes a problem row, replace substitutes U+FFFD)."""
    with _open(path) as f:
        for number, raw in enumerate(f, start=1):
            try:
                text = raw.decode(
                    "utf-8", errors="replace" if decode_errors == "replace" else "strict"
                )
            except UnicodeDecodeError as err:
                if decode_errors == "strict":
                    raise
                yield Row(number, problem=f"undecodable bytes at byte {err.start} of the line")
                continue
            if not text.strip():
                continue
            try:
                value = json.loads(text)
            except ValueError as err:
                yield Row(number, problem=f"malformed JSON ({err})")
                continue
            if not isinstance(value, dict):
                yield Row(number, problem=f"a JSON {type(value).__name__}, not an object")
                continue
            yield Row(number, value)
