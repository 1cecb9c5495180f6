"""The shard writer of one split: a token stream cut into fixed-size shards, resumable by shard.

Shard k holds tokens [k*S, (k+1)*S) of the split's stream (documents back to back, each ending
with EOT), so a document may continue into the next shard. A shard becomes visible in three
steps: `.bin` written under a temporary name and renamed, then `.idx`, then its `.json` record,
which is the commit point. On restart, shards with a record are kept, everything after them is
removed, and writing resumes at the record's `end`: (source document index, tokens of that
document already written). Re-encoding the same documents therefore rewrites the same bytes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from data.atomic import atomic_write_bytes, atomic_write_json, remove_temporaries, temporary_sibling
from data.manifest import INDEX_DTYPE, ShardRecord, file_checksum

FLUSH_BYTES = 1 << 23  # buffer this much before a write()


class ShardWriter:
    def __init__(self, root: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.root, self.split = root, split
        self.dir = root / split
        self.dir.mkdir(parents=True, exist_ok=True)
        self.dtype, self.shard_tokens = np.dtype(dtype), shard_tokens
        self.records = self._finished_records()
        self.complete = bool(self.records) and self.records[-1]["final"]
        self.resume_doc, self.resume_offset = self.records[-1]["end"] if self.records else (0, 0)
        self._remove_unfinished()
        self._open_shard()

    # -- restart ---------------------------------------------------------------------------
    def _name(self, k: int, ext: str) -> Path:
        return self.dir / f"{k:05d}.{ext}"

    def _finished_records(self) -> list[dict]:
        """Leading shards whose record exists and whose files have the recorded sizes."""
        records: list[dict] = []
        while (meta := self._name(len(records), "json")).is_file():
            try:
                rec = json.loads(meta.read_text())
            except ValueError:  # a damaged record commits nothing: redo from this shard
                break
            k = len(records)
            if (
                rec.get("index") != k
                or _size(self._name(k, "bin")) != rec["tokens"] * self.dtype.itemsize
                or _size(self._name(k, "idx")) != rec["documents"] * INDEX_DTYPE.itemsize
            ):
                break
            records.append(rec)
        return records

    def _remove_unfinished(self) -> None:
        remove_temporaries(self.dir)
        for path in self.dir.iterdir():
            stem = path.name.split(".")[0]
            if stem.isdigit() and int(stem) >= len(self.records):
                path.unlink()

    def wants(self, doc_index: int) -> bool:
        """False for documents already written by an earlier run."""
        return not self.complete and doc_index >= self.resume_doc

    # -- writing ---------------------------------------------------------------------------
    def _open_shard(self) -> None:
        k = len(self.records)
        self._bin_path = self._name(k, "bin")
        self._tmp = temporary_sibling(self._bin_path)
        self._file = open(self._tmp, "wb")  # noqa: SIM115 (closed in _close_shard / close)
        self._pending: list[np.ndarray] = []
        self._pending_bytes = 0
        self._in_shard = 0
        self._starts: list[int] = []

    def append(self, doc_index: int, tokens: np.ndarray) -> None:
        """Add one whole document (EOT included); the resumed document drops what was written."""
        pos = 0
        if doc_index == self.resume_doc:
            pos = self.resume_offset
            self.resume_doc = -1
        if pos == 0:
            self._starts.append(self._in_shard)
        while pos < len(tokens):
            take = min(len(tokens) - pos, self.shard_tokens - self._in_shard)
            self._write(tokens[pos : pos + take])
            pos += take
            if self._in_shard == self.shard_tokens:
                self._close_shard(end=(doc_index, pos), final=False)
                self._open_shard()

    def _write(self, chunk: np.ndarray) -> None:
        self._pending.append(chunk.astype(self.dtype, copy=False))
        self._pending_bytes += chunk.size * self.dtype.itemsize
        self._in_shard += chunk.size
        if self._pending_bytes >= FLUSH_BYTES:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            self._file.write(np.concatenate(self._pending).tobytes())
        self._pending, self._pending_bytes = [], 0

    def _close_shard(self, end: tuple[int, int], final: bool) -> None:
        self._flush()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        k = len(self.records)
        os.replace(self._tmp, self._bin_path)
        idx_path = self._name(k, "idx")
        atomic_write_bytes(idx_path, np.asarray(self._starts, dtype=INDEX_DTYPE).tobytes())
        rec = {
            "index": k,
            "tokens": self._in_shard,
            "documents": len(self._starts),
            "checksum": file_checksum(self._bin_path),
            "idx_checksum": file_checksum(idx_path),
            "end": list(end),
            "final": final,
        }
        atomic_write_json(self._name(k, "json"), rec)
        self.records.append(rec)

    def finish(self, end_doc: int) -> list[ShardRecord]:
        """Write the last (short) shard, mark the split complete and return its shard records."""
        if self.complete:
            self._discard_open_shard()
        elif self._in_shard:
            self._close_shard(end=(end_doc, 0), final=True)
        elif self.records:  # the stream ended exactly at a shard boundary
            self._discard_open_shard()
            self.records[-1]["final"] = True
            atomic_write_json(self._name(len(self.records) - 1, "json"), self.records[-1])
        else:  # an empty split: no shard at all
            self._discard_open_shard()
        self.complete = True
        return [self._record(rec) for rec in self.records]

    def _discard_open_shard(self) -> None:
        self._file.close()
        self._tmp.unlink(missing_ok=True)

    def close(self) -> None:
        """Abandon the open shard (an interrupted run): nothing unfinished stays visible."""
        if not self._file.closed:
            self._discard_open_shard()

    def _record(self, rec: dict) -> ShardRecord:
        k = rec["index"]
        rel = f"{self.split}/{k:05d}"
        return ShardRecord(
            bin=f"{rel}.bin",
            idx=f"{rel}.idx",
            tokens=rec["tokens"],
            documents=rec["documents"],
            checksum=rec["checksum"],
            idx_checksum=rec["idx_checksum"],
        )


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else -1
