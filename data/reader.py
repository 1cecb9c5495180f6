"""Reading one split of a prepared dataset: memory-mapped shards seen as one token stream.

Window i of a split holds stream tokens [i*T, i*T + T + 1) (T = seq_len): inputs are the first
T, targets the last T, so consecutive windows share one token and every token is a target once.
Document boundaries come from the shards' `.idx` offsets; `doc_ids` numbers the documents inside
each window from 0 (runs of equal ids, which is what the model's document mask expects).

Shards are mapped lazily per process (a pickled reader carries no maps), at most
MAX_OPEN_SHARDS at a time. They are checked on open: a missing or truncated file always stops
with its name; checksums are verified when a process first reads a shard (`verify=lazy`: once
per shard and process, so each loader worker checks what it reads), for all shards at once
(`full`), or never (`size`).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path

import numpy as np

from data.errors import DataError
from data.manifest import INDEX_DTYPE, Manifest, ShardRecord, file_checksum

MAX_OPEN_SHARDS = 64  # memory maps kept open per process (two file descriptors each)


class SplitReader:
    def __init__(self, manifest: Manifest, split: str, verify: str = "lazy"):
        self.root, self.split, self.verify = manifest.root, split, verify
        self.dtype = manifest.dtype
        self.vocab_size = manifest.vocab_size
        self.records: list[ShardRecord] = manifest.splits[split]
        sizes = np.array([r.tokens for r in self.records], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(sizes)])  # (shards + 1,) stream offsets
        self.tokens = int(self.starts[-1])
        docs = np.array([r.documents for r in self.records], dtype=np.int64)
        self.doc_starts = np.concatenate([[0], np.cumsum(docs)])  # (shards + 1,) documents before
        self.documents = int(self.doc_starts[-1])
        for rec in self.records:
            self._check_sizes(rec)
        self._verified: set[int] = set()
        if verify == "full":
            for k in range(len(self.records)):
                self._verify(k)
        self._maps: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._pid = os.getpid()

    def __getstate__(self) -> dict:
        """Pickled for a spawned worker: without the maps (np.memmap would pickle its bytes)."""
        state = dict(self.__dict__)
        state["_maps"] = OrderedDict()
        return state

    def _fix(self) -> str:
        return (
            f"re-run the `python -m data.prepare ... out={self.root}` command that made it "
            f"(its settings are in {self.root}/prepare.json): it rewrites missing or damaged shards"
        )

    def _check_sizes(self, rec: ShardRecord) -> None:
        for rel, expected in (
            (rec.bin, rec.tokens * self.dtype.itemsize),
            (rec.idx, rec.documents * INDEX_DTYPE.itemsize),
        ):
            path = self.root / rel
            if not path.is_file():
                raise DataError(f"shard {path} is missing; {self._fix()}")
            size = path.stat().st_size
            if size != expected:
                raise DataError(
                    f"shard {path} is truncated or damaged: {size} bytes, the manifest says "
                    f"{expected}; {self._fix()}"
                )

    def _verify(self, k: int) -> None:
        rec = self.records[k]
        for rel, expected in ((rec.bin, rec.checksum), (rec.idx, rec.idx_checksum)):
            path = self.root / rel
            if file_checksum(path) != expected:
                raise DataError(f"shard {path} does not match its checksum; {self._fix()}")
        self._verified.add(k)

    def _shard(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, document offsets) of shard k, memory-mapped on first use in this process.
        At most MAX_OPEN_SHARDS stay mapped (least recently used go first), so a shuffled
        read over thousands of shards never runs out of file descriptors."""
        if self._pid != os.getpid():  # a forked worker: maps are per process
            self._maps, self._pid = OrderedDict(), os.getpid()
        if k in self._maps:
            self._maps.move_to_end(k)
            return self._maps[k]
        if self.verify == "lazy" and k not in self._verified:
            self._verify(k)
        rec = self.records[k]
        tokens, offsets = (
            _map(self.root / rec.bin, self.dtype),
            _map(self.root / rec.idx, INDEX_DTYPE),
        )
        # once per shard and process, whatever data.verify says: O(documents), not O(tokens)
        if offsets.size and (
            offsets[0] < 0 or offsets[-1] >= max(rec.tokens, 1) or np.any(np.diff(offsets) <= 0)
        ):
            raise DataError(
                f"shard {self.root / rec.bin} is damaged (its document offsets in {rec.idx} are "
                f"not increasing inside the shard); {self._fix()}"
            )
        self._maps[k] = (tokens, offsets)
        if len(self._maps) > MAX_OPEN_SHARDS:
            self._maps.popitem(last=False)  # windows are copies, so no view keeps it open
        return self._maps[k]

    def document_at(self, position: int) -> int:
        """The index (within the split) of the document holding stream token `position`."""
        k = int(np.searchsorted(self.starts, position, side="right")) - 1
        _, offsets = self._shard(k)
        local = int(np.searchsorted(offsets, position - int(self.starts[k]), side="right")) - 1
        return int(self.doc_starts[k]) + local  # -1 locally: it began in an earlier shard

    def num_windows(self, seq_len: int) -> int:
        return max(0, (self.tokens - 1) // seq_len)

    def window(self, i: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        """Window i: (tokens (T+1,) int64, doc_ids (T,) int32). Damaged shards that passed the
        size check (data.verify=size) stop with their name, not an IndexError later."""
        start, length = i * seq_len, seq_len + 1
        if i < 0 or start + length > self.tokens:
            raise IndexError(f"window {i} of seq_len {seq_len} is outside the {self.split} split")
        try:
            tokens, doc_ids = self._window(start, length, seq_len)
        except IndexError:
            raise DataError(self._damaged(start, "its document offsets are out of range")) from None
        if tokens.min() < 0 or tokens.max() >= self.vocab_size:
            raise DataError(
                self._damaged(start, f"it holds token ids outside [0, {self.vocab_size})")
            )
        return tokens, doc_ids

    def _damaged(self, start: int, what: str) -> str:
        k = int(np.searchsorted(self.starts, start, side="right")) - 1
        return f"shard {self.root / self.records[k].bin} is damaged ({what}); {self._fix()}"

    def _window(self, start: int, length: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        tokens = np.empty(length, dtype=np.int64)
        is_start = np.zeros(length, dtype=np.int32)
        k = int(np.searchsorted(self.starts, start, side="right")) - 1
        filled = 0
        while filled < length:
            shard_tokens, doc_offsets = self._shard(k)
            lo = start + filled - int(self.starts[k])
            hi = min(len(shard_tokens), lo + length - filled)
            tokens[filled : filled + hi - lo] = shard_tokens[lo:hi]
            first, last = np.searchsorted(doc_offsets, [lo, hi])
            starts = doc_offsets[first:last] - lo + filled
            if starts.size and (starts.min() < filled or starts.max() >= filled + hi - lo):
                raise IndexError("document offsets outside the shard piece")  # unsorted: damaged
            is_start[starts] = 1
            filled += hi - lo
            k += 1
        is_start[0] = 0  # ids count documents from the window's first token
        return tokens, np.cumsum(is_start[:seq_len], dtype=np.int32)


def _map(path: Path, dtype: np.dtype) -> np.ndarray:
    if path.stat().st_size == 0:
        return np.empty(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")
