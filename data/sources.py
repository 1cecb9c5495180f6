"""Raw-text sources: files, directories and globs of text; local json/jsonl/parquet/csv; HF datasets;
and the embedded default corpus (the Python standard library's own sources).

Every source yields `Document`s in one fixed order with a running index, so preparation is
deterministic and a re-run can skip what is already written. Undecodable bytes follow
`decode_errors`: `strict` stops with the file and byte offset, `skip` drops the file, `replace`
keeps it with U+FFFD; both of the latter are reported per file.
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import logging
import lzma
import os
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from data import jsonl
from data.errors import DataError

log = logging.getLogger(__name__)
DECODE_ERRORS = ("strict", "skip", "replace")
STRUCTURED = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
COMPRESSED = {".gz", ".bz2", ".xz", ".zst"}
MAX_LISTED = 100  # per-file problems kept in the manifest; the rest are counted
# named document separators for text files (any other value is used literally)
SEPARATORS = {"blank_line": "\n\n", "line": "\n", "eot": "<|endoftext|>"}
READ_BYTES = 1 << 23


@dataclass
class Document:
    index: int  # position in the source's fixed order (skipped files keep their index)
    text: str
    origin: str  # file path, or `dataset[row]`
    split: str | None = None  # train | val when decided by its piece (data.pieces), else None


@dataclass
class SourceReport:
    """What was dropped or altered, for the log and the manifest."""

    files: int = 0
    skipped: list[dict[str, str]] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)
    skipped_count: int = 0
    replaced_count: int = 0
    empty: int = 0  # documents with no text
    missing_text: int = 0  # rows whose text column is absent or null

    def skip(self, origin: str, reason: str) -> None:
        self.skipped_count += 1
        if len(self.skipped) < MAX_LISTED:
            self.skipped.append({"origin": origin, "reason": reason})
            log.warning("skipped %s: %s", origin, reason)
        elif self.skipped_count == MAX_LISTED + 1:
            log.warning("more inputs skipped: counted from now on, not listed")

    def replace(self, origin: str) -> None:
        self.replaced_count += 1
        if len(self.replaced) < MAX_LISTED:
            self.replaced.append(origin)
            log.warning("replaced undecodable bytes in %s with U+FFFD", origin)
        elif self.replaced_count == MAX_LISTED + 1:
            log.warning("more inputs with replaced bytes: counted from now on, not listed")

    def to_dict(self) -> dict[str, Any]:
        return {
            "files": self.files,
            "empty_documents": self.empty,
            "rows_without_text": self.missing_text,
            "skipped_count": self.skipped_count,
            "skipped": self.skipped,
            "replaced_count": self.replaced_count,
            "replaced": self.replaced,
        }


@dataclass(kw_only=True)
class SourceOptions:
    text_column: str = "text"
    hf_split: str = "train"
    hf_config: str | None = None
    decode_errors: str = "skip"
    include: str = "*"  # file-name pattern applied inside directories
    doc_separator: str = (
        ""  # text files: "" = one file, one document; blank_line | line | eot | text
    )


class Source:
    """A resolved source spec; iterate `documents()` (re-iterable, same order every time)."""

    def __init__(self, spec: str, options: SourceOptions):
        if options.decode_errors not in DECODE_ERRORS:
            raise DataError(f"decode_errors={options.decode_errors} is not one of {DECODE_ERRORS}")
        self.spec, self.options = spec, options
        self.report = SourceReport()
        self.kind, self.files = _resolve(spec, options.include)
        self.stats = {f: _identity(f) for f in self.files}  # (size, mtime) when listed
        self.total_bytes = sum(size for size, _ in self.stats.values()) if self.files else None

    def files_digest(self, legacy: bool = False) -> str:
        """Absolute names and sizes of the source files (empty for HF datasets): a change between
        a crash and the re-run would otherwise mix two corpora in one dataset. `legacy`: the
        names as given (what earlier versions recorded)."""
        h = hashlib.sha256()
        for path in self.files:
            name = path if legacy else path.resolve()
            h.update(f"{name}\t{path.stat().st_size}\n".encode())
        return h.hexdigest()[:16]

    def _check_unchanged(self, path: Path) -> None:
        """A file written to while it is read would put half of it in the dataset."""
        before, now = self.stats.get(path), _identity(path)
        if before is not None and now != before:
            raise DataError(
                f"{path} changed while it was being prepared ({before[0]} -> {now[0]} bytes): "
                f"wait until it is complete, then prepare again (into a new out=, or delete the "
                f"partial one)"
            )

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"spec": self.spec, "kind": self.kind}
        if self.kind == "hf":
            d.update(split=self.options.hf_split, config=self.options.hf_config)
        if self.kind in ("hf", "structured"):
            d["text_column"] = self.options.text_column
        return d | self.report.to_dict()

    def documents(self) -> Iterator[Document]:
        self.report = SourceReport(files=len(self.files))
        if self.kind == "hf":
            rows = _hf_rows(self.spec.removeprefix("hf:"), self.options)
            yield from self._from_rows(rows, self.spec)
        elif self.kind == "structured":
            yield from self._from_structured_files()
        else:
            yield from self._from_text_files()

    def _from_text_files(self) -> Iterator[Document]:
        separator = SEPARATORS.get(self.options.doc_separator, self.options.doc_separator)
        if separator:
            yield from self._split_text_files(separator.encode())
            return
        for index, path in enumerate(self.files):
            text = self._decode(path.read_bytes(), str(path), 0)
            self._check_unchanged(path)
            if text is None:
                continue
            if not text:
                self.report.empty += 1
                continue
            yield Document(index, text, str(path))

    def _split_text_files(self, separator: bytes) -> Iterator[Document]:
        """Every piece between separators is a document; files are streamed, never read whole."""
        index = 0
        for path in self.files:
            for offset, raw in _pieces(path, separator):
                text = self._decode(raw, f"{path}@{offset}", offset)
                index += 1
                if text is None:
                    continue
                if not text.strip():
                    self.report.empty += 1
                    continue
                yield Document(index - 1, text, f"{path}@{offset}")
            self._check_unchanged(path)

    def _decode(self, raw: bytes, origin: str, offset: int) -> str | None:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as err:
            at = offset + err.start
            if self.options.decode_errors == "strict":
                raise DataError(
                    f"{origin}: undecodable bytes at byte {at} ({err.reason}); "
                    f"set decode_errors=skip or replace"
                ) from err
            if self.options.decode_errors == "skip":
                self.report.skip(origin, f"undecodable bytes at byte {at}")
                return None
            self.report.replace(origin)
            return raw.decode("utf-8", errors="replace")

    def _from_structured_files(self) -> Iterator[Document]:
        index = 0
        for path in self.files:
            if jsonl.readable(path):
                for doc in self._from_json_lines(path, index):
                    index = doc.index + 1
                    yield doc
                self._check_unchanged(path)
                continue
            kept = 0
            try:
                rows = _structured_rows(path, self.options.text_column)
                for doc in self._from_rows(rows, str(path), start=index):
                    index = doc.index + 1
                    kept += 1
                    yield doc
            except _RowsFailed as err:
                if self.options.decode_errors == "strict":
                    raise DataError(f"{path}: {err}; set decode_errors=skip to drop it") from err
                what = f"kept the {kept} documents before it" if kept else "nothing kept"
                self.report.skip(str(path), f"{err} ({what})")
            self._check_unchanged(path)

    def _from_json_lines(self, path: Path, start: int) -> Iterator[Document]:
        """One row per line; a bad line is skipped alone (or fatal with decode_errors=strict).
        A file that cannot be read on (a truncated or corrupt compressed file) keeps the rows
        before the damage, like a broken parquet or csv file."""
        try:
            yield from self._json_line_documents(path, start)
        except (OSError, EOFError, lzma.LZMAError, zlib.error) as err:
            if self.options.decode_errors == "strict":
                raise DataError(
                    f"{path}: cannot be read ({type(err).__name__}: {err}); "
                    f"set decode_errors=skip to keep the rows before the damage"
                ) from err
            self.report.skip(str(path), f"cannot be read on ({type(err).__name__}: {err})")

    def _json_line_documents(self, path: Path, start: int) -> Iterator[Document]:
        strict = self.options.decode_errors == "strict"
        valid = 0
        try:
            for i, row in enumerate(jsonl.rows(path, self.options.decode_errors)):
                origin = f"{path}:{row.line}"
                if row.problem:
                    if strict:
                        raise DataError(
                            f"{origin}: {row.problem}; set decode_errors=skip to drop such lines"
                        )
                    self.report.skip(origin, row.problem)
                    continue
                doc = self._row_document(row.value, start + i, origin, first=valid == 0)
                valid += 1
                if doc is not None:
                    yield doc
        except UnicodeDecodeError as err:  # strict: the first bad line stops the preparation
            raise DataError(
                f"{path}: undecodable bytes ({err.reason}); set decode_errors=skip or replace"
            ) from err

    def _from_rows(self, rows: Iterator[Any], origin: str, start: int = 0) -> Iterator[Document]:
        for i, row in enumerate(rows):
            doc = self._row_document(row, start + i, f"{origin}[{i}]", first=i == 0)
            if doc is not None:
                yield doc

    def _row_document(self, row: dict, index: int, origin: str, first: bool) -> Document | None:
        """The document of one row; None (counted) when its text is absent, null or empty."""
        column = self.options.text_column
        if first and column not in row:
            raise DataError(
                f"{origin} has no column {column!r} (columns: {sorted(row)}); "
                f"set text_column=<one of them>"
            )
        text = row.get(column)
        if text is None:  # absent from this row, or null
            self.report.missing_text += 1
            return None
        if not isinstance(text, str):
            self.report.skip(origin, f"{column!r} holds a {type(text).__name__}, not text")
            return None
        if not text:
            self.report.empty += 1
            return None
        return Document(index, text, origin)


class _RowsFailed(Exception):
    """A structured file could not be parsed (bad JSON, bad bytes, bad parquet)."""


def _identity(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


def _structured_rows(path: Path, column: str) -> Iterator[dict]:
    import datasets

    suffixes = [s for s in path.suffixes if s not in COMPRESSED]
    builder = STRUCTURED[suffixes[-1]]
    try:
        ds = datasets.load_dataset(builder, data_files=str(path), split="train", streaming=True)
        yield from ds
    except DataError:
        raise
    except Exception as err:  # datasets wraps parser errors in several types
        raise _RowsFailed(f"cannot read as {builder}: {_root_cause(err)}") from err


def _root_cause(err: BaseException) -> str:
    while err.__cause__ is not None:
        err = err.__cause__
    return f"{type(err).__name__}: {err}"[:300]


def _hf_rows(name: str, options: SourceOptions) -> Iterator[dict]:
    import datasets

    path = Path(name).expanduser()
    if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
        ds = datasets.load_from_disk(str(path))  # a `save_to_disk` directory (memory-mapped)
        if isinstance(ds, datasets.DatasetDict):
            if options.hf_split not in ds:
                raise DataError(f"{path} has splits {sorted(ds)}, not hf_split={options.hf_split}")
            ds = ds[options.hf_split]
        return iter(ds)
    try:
        ds = datasets.load_dataset(name, options.hf_config, split=options.hf_split, streaming=True)
    except Exception as err:
        raise DataError(
            f"source=hf:{name} could not be loaded ({_root_cause(err)}). Offline, a hub dataset "
            f"must already be in the HF cache (HF_DATASETS_OFFLINE=1); a local directory works "
            f"with data files or a save_to_disk copy; check hf_config and hf_split"
        ) from err
    return iter(ds)


def _resolve(spec: str, include: str) -> tuple[str, list[Path]]:
    """(kind, files): kind is stdlib | hf | structured | text."""
    if not spec:
        raise DataError("source is empty: pass source=<file|dir|glob|hf:<dataset>|stdlib>")
    if spec == "stdlib":
        return "stdlib", stdlib_files()
    if spec.startswith("hf:"):
        return "hf", []
    files = _list_files(spec, include)
    structured = [f for f in files if _is_structured(f)]
    if structured and len(structured) != len(files):
        raise DataError(
            f"source={spec} mixes text files with json/jsonl/parquet/csv files "
            f"(e.g. {structured[0]}); point it at one kind, or narrow it with include=<pattern>"
        )
    return ("structured" if structured else "text"), files


def _is_structured(path: Path) -> bool:
    suffixes = [s for s in path.suffixes if s not in COMPRESSED]
    return bool(suffixes) and suffixes[-1] in STRUCTURED


def _list_files(spec: str, include: str) -> list[Path]:
    path = Path(spec).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        files = [
            f
            for f in sorted(path.rglob("*"), key=lambda p: p.relative_to(path).as_posix())
            if f.is_file()
            and fnmatch.fnmatch(f.name, include)
            and not any(part.startswith(".") for part in f.relative_to(path).parts)
        ]
        if not files:
            raise DataError(f"source={spec} is a directory with no files matching {include!r}")
        return files
    if glob.has_magic(spec):
        files = [Path(p) for p in sorted(glob.glob(str(path), recursive=True))]
        files = [f for f in files if f.is_file()]
        if not files:
            raise DataError(f"source={spec} matches no files")
        return files
    raise DataError(f"source={spec} does not exist (not a file, a directory, a glob or hf:<name>)")


def stdlib_files() -> list[Path]:
    """The default corpus: every .py under the standard library, without site/dist-packages,
    ordered by relative path so each machine with the same Python reads the same text."""
    root = Path(sysconfig.get_paths()["stdlib"])
    excluded = {"site-packages", "dist-packages"}
    files = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in excluded]  # prune: never walk into them
        files.extend(Path(directory, n) for n in names if n.endswith(".py"))
    if not files:
        raise DataError(f"no Python sources under the standard library at {root}")
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _pieces(path: Path, separator: bytes) -> Iterator[tuple[int, bytes]]:
    """(byte offset, bytes) of each piece of `path` between separators, read in blocks."""
    offset, carry = 0, b""
    with open(path, "rb") as f:
        while block := f.read(READ_BYTES):
            parts = (carry + block).split(separator)
            carry = parts.pop()
            for part in parts:
                yield offset, part
                offset += len(part) + len(separator)
    yield offset, carry
