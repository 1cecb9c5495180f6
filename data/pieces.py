"""A validation split for corpora of one or a few documents (the classic first run: one
`input.txt`), which a per-document hash split would leave without any validation text.

Documents are cut into pieces of about `piece_chars` characters, at a paragraph boundary
(a blank line, else a line end) at or after each target length. The pieces, counted over the
whole source in order, go to validation at an even stride: piece g is held out when
floor((g + 1) f + u) > floor(g f + u), with f = val_fraction and u in [0, 1) from the split
seed, so about f of them are held out, spread over the corpus rather than clustered at its end.
Consecutive training pieces of one document are joined again, so the training text keeps its
continuity and gets an end-of-text token only where a held-out piece was taken out.

`piece_chars=-1` (auto) cuts only text sources whose files are the documents and whose file
count is too small for the hash split (files x val_fraction < MIN_VAL_PIECES), and sizes the
pieces so that about MIN_VAL_PIECES of them are held out.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

from data.sources import Document, Source

MIN_VAL_PIECES = 4  # auto: held-out pieces to aim for
MIN_PIECE_CHARS, MAX_PIECE_CHARS = 256, 1 << 20


def plan_pieces(source: Source, piece_chars: int, val_fraction: float, separator: str) -> int:
    """The piece size to cut at (0: no cutting, the per-document hash split applies)."""
    if piece_chars >= 0 or val_fraction == 0:
        return max(piece_chars, 0)
    few = len(source.files) * val_fraction < MIN_VAL_PIECES
    if source.kind != "text" or separator or not few or not source.total_bytes:
        return 0
    size = int(source.total_bytes * val_fraction / MIN_VAL_PIECES)
    return min(max(size, MIN_PIECE_CHARS), MAX_PIECE_CHARS)


@dataclass
class PieceReport:
    piece_chars: int
    fraction: float
    documents: int = 0
    pieces: int = 0
    val_pieces: int = 0
    val_chars: int = 0

    def to_dict(self) -> dict:
        keys = ("piece_chars", "fraction", "documents", "pieces", "val_pieces", "val_chars")
        return {k: getattr(self, k) for k in keys}

    def describe(self) -> str:
        return (
            f"cut {self.documents} document(s) into {self.pieces} pieces of about "
            f"{self.piece_chars} characters at paragraph boundaries; {self.val_pieces} pieces "
            f"({self.val_chars} characters, a fraction of {self.fraction:.3g}) held out for "
            f"validation, spread over the corpus"
        )


class PieceSplit:
    """Cuts documents and assigns every piece to a split; re-iterable (same result each time)."""

    def __init__(self, piece_chars: int, val_fraction: float, seed: int):
        self.piece_chars, self.fraction = piece_chars, val_fraction
        digest = hashlib.blake2b(f"pieces:{seed}".encode(), digest_size=8).digest()
        self.offset = int.from_bytes(digest, "little") / 2**64  # u in [0, 1)
        self.report = PieceReport(piece_chars, val_fraction)

    def held_out(self, g: int) -> bool:
        f, u = self.fraction, self.offset
        return math.floor((g + 1) * f + u) > math.floor(g * f + u)

    def documents(self, docs: Iterator[Document]) -> Iterator[Document]:
        """Training runs and held-out pieces as documents, numbered 0, 1, ... in order."""
        self.report = PieceReport(self.piece_chars, self.fraction)
        index = piece = 0
        for doc in docs:
            self.report.documents += 1
            run: list[str] = []
            for text in cut(doc.text, self.piece_chars):
                self.report.pieces += 1
                if not self.held_out(piece):
                    run.append(text)
                else:
                    if run:
                        yield Document(index, "".join(run), doc.origin, split="train")
                        index, run = index + 1, []
                    self.report.val_pieces += 1
                    self.report.val_chars += len(text)
                    yield Document(index, text, f"{doc.origin}#piece{piece}", split="val")
                    index += 1
                piece += 1
            if run:
                yield Document(index, "".join(run), doc.origin, split="train")
                index += 1


def cut(text: str, size: int) -> Iterator[str]:
    """Pieces of `text` of about `size` characters, each ending at the paragraph break (else the
    line break, else exactly the target) nearest to its target, within half a piece of it."""
    start = 0
    while len(text) - start > size * 3 // 2:
        target = start + size
        end = _nearest_break(text, "\n\n", target, size // 2)
        if end < 0:
            end = _nearest_break(text, "\n", target, size // 2)
        end = end if end > start else target
        yield text[start:end]
        start = end
    if start < len(text):
        yield text[start:]


def _nearest_break(text: str, mark: str, target: int, reach: int) -> int:
    """The end (after `mark`) of the occurrence nearest to `target` within `reach`; -1: none."""
    after = text.find(mark, target, target + reach)
    before = text.rfind(mark, target - reach, target)
    ends = [at + len(mark) for at in (after, before) if at >= 0]
    return min(ends, key=lambda e: abs(e - target)) if ends else -1
