"""`python -m data.prepare`: raw text or a dataset -> tokenizer + tokenized shards + manifest.

    python -m data.prepare source=<file|dir|glob|hf:<dataset>|stdlib> out=<dir> \
        tokenizer=<train|cl100k_base|path/to/file.tiktoken> vocab_size=<N>

Documents are read in the source's fixed order, sent to the training or validation split by a
seeded hash of their index, tokenized by threads, and written as fixed-size shards
(see `data.writer`). The run is resumable: interrupted, it keeps every finished shard and a
re-run of the same command writes the rest, byte-identical to an uninterrupted run. On a
finished dataset it verifies the shards and rewrites any that are missing or damaged.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import hydra
import numpy as np
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from data.atomic import atomic_write_json, is_disk_full, remove_temporaries
from data.bpe import train_bpe
from data.config import PrepareConfig
from data.encode_pool import EncodePool
from data.errors import DataError
from data.manifest import FORMAT, MANIFEST, SPLITS, Manifest, file_checksum
from data.pieces import PieceSplit, plan_pieces
from data.prepare_settings import (
    claim,
    recorded_tokenizer,
    remember_tokenizer,
)
from data.sources import Document, Source, SourceOptions
from data.tokenizer import (
    META_FILE,
    Tokenizer,
    load_tokenizer,
    load_verified_tokenizer,
)
from data.writer import ShardWriter

log = logging.getLogger("data.prepare")
LOCK_FILE = ".lock"
BATCH_CHARS = 1 << 20  # text per batch handed to an encoding thread
BATCH_DOCS = 2048


class DocumentSplit:
    """Document `index` goes to validation when a seeded hash of it falls below `val_fraction`."""

    def __init__(self, val_fraction: float, seed: int):
        self.threshold = int(val_fraction * (1 << 64))
        self.seed = seed

    def __call__(self, index: int) -> str:
        digest = hashlib.blake2b(f"{self.seed}:{index}".encode(), digest_size=8).digest()
        return "val" if int.from_bytes(digest, "little") < self.threshold else "train"


class Assigner:
    """The documents to prepare, each with its split: the document hash, or the piece stride
    when the corpus is cut into pieces (data.pieces)."""

    def __init__(self, by_hash: DocumentSplit, pieces: PieceSplit | None, max_documents: int):
        self.by_hash, self.pieces, self.max_documents = by_hash, pieces, max_documents

    def documents(self, source: Source) -> Iterator[Document]:
        docs = _limited(source.documents(), self.max_documents)
        return self.pieces.documents(docs) if self.pieces else docs

    def __call__(self, doc: Document) -> str:
        return doc.split or self.by_hash(doc.index)


def token_dtype(choice: str, vocab_size: int) -> np.dtype:
    if choice == "auto":
        return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)
    dtype = np.dtype(choice)
    if vocab_size > np.iinfo(dtype).max + 1:
        raise DataError(
            f"token_dtype={choice} holds ids below {np.iinfo(dtype).max + 1}, but the tokenizer "
            f"has {vocab_size} ids; use token_dtype=uint32 (or auto)"
        )
    return dtype


def prepare(cfg: PrepareConfig) -> Manifest:
    """Prepare (or finish, or repair) the dataset that `cfg` describes; returns its manifest."""
    out = cfg.output_dir()
    _make_dir(out)
    with _exclusive(out):
        return _prepare_locked(cfg, out)


def _make_dir(out: Path) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DataError(
            f"out={out} cannot be created ({err.strerror}: {err.filename}); pass out=<a directory>"
        ) from None


@contextmanager
def _exclusive(out: Path) -> Iterator[None]:
    """One preparation per directory at a time (an advisory lock on `out/.lock`)."""
    with open(out / LOCK_FILE, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as err:
            raise DataError(
                f"another `python -m data.prepare` is writing to out={out}; wait for it to finish"
            ) from err
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _prepare_locked(cfg: PrepareConfig, out: Path) -> Manifest:
    for directory in (out, out / "tokenizer"):
        if directory.is_dir():
            remove_temporaries(directory)
    source = Source(cfg.source, _source_options(cfg))
    legacy = claim(out, cfg, source)
    if (out / MANIFEST).is_file() and not _forget_damaged_shards(out, cfg.progress):
        log.info("%s is already prepared (all shards verified)", out)
        return Manifest.load(out)
    piece_chars = plan_pieces(source, cfg.piece_chars, cfg.val_fraction, cfg.doc_separator)
    if "piece_chars" in legacy:
        piece_chars = 0
    pieces = PieceSplit(piece_chars, cfg.val_fraction, cfg.split_seed) if piece_chars else None
    split = Assigner(DocumentSplit(cfg.val_fraction, cfg.split_seed), pieces, cfg.max_documents)
    with EncodePool(cfg.workers or len(os.sched_getaffinity(0))) as pool:
        tokenizer = _obtain_tokenizer(cfg, out, source, split)
        dtype = token_dtype(cfg.token_dtype, tokenizer.vocab_size)
        pool.start(tokenizer, dtype)
        writers = {name: ShardWriter(out, name, dtype, cfg.shard_tokens) for name in SPLITS}
        try:
            end_doc = _tokenize_source(cfg, source, split, writers, pool)
            records = {name: w.finish(end_doc) for name, w in writers.items()}
        finally:
            for w in writers.values():
                w.close()
    if not records["train"]:
        raise DataError(
            f"source={cfg.source}: every document went to validation; prepare again with a "
            f"lower val_fraction into another out= (or delete {out})"
        )
    if cfg.val_fraction > 0 and not records["val"]:
        log.warning(
            "no document went to validation (val_fraction=%s); train with data.val_batches=0, "
            "or prepare again with a larger val_fraction into another out=",
            cfg.val_fraction,
        )
    manifest = {
        "format": FORMAT,
        "tokenizer": tokenizer.identity.to_dict()
        | {"vocab_size": tokenizer.vocab_size, "eot_id": tokenizer.eot_id, "dir": "tokenizer"},
        "dtype": dtype.name,
        "source": source.describe() | ({"pieces": pieces.report.to_dict()} if pieces else {}),
        "settings": cfg.fingerprint(),
        "splits": {
            name: {
                "tokens": sum(r.tokens for r in recs),
                "documents": sum(r.documents for r in recs),
                "shards": [r.to_dict() for r in recs],
            }
            for name, recs in records.items()
        },
    }
    atomic_write_json(out / MANIFEST, manifest)
    if pieces is not None:
        log.info("%s has few documents: %s", cfg.source, pieces.report.describe())
    _warn_about_dropped_input(source)
    result = Manifest.load(out)
    log.info(
        "wrote %s: %d train tokens in %d shards, %d validation tokens (%s, %s)",
        out / MANIFEST,
        result.tokens("train"),
        len(result.splits["train"]),
        result.tokens("val"),
        dtype.name,
        tokenizer.identity.short(),
    )
    return result


def _warn_about_dropped_input(source: Source) -> None:
    report = source.report
    if report.missing_text:
        log.warning(
            "%d rows have no %r value (absent or null) and were left out; set text_column= if "
            "the text is in another column",
            report.missing_text,
            source.options.text_column,
        )
    if report.skipped_count or report.replaced_count:
        log.warning(
            "%d inputs skipped and %d with replaced bytes (listed under `source` in %s)",
            report.skipped_count,
            report.replaced_count,
            MANIFEST,
        )


def _source_options(cfg: PrepareConfig) -> SourceOptions:
    return SourceOptions(
        text_column=cfg.text_column,
        hf_split=cfg.hf_split,
        hf_config=cfg.hf_config,
        decode_errors=cfg.decode_errors,
        include=cfg.include,
        doc_separator=cfg.doc_separator,
    )


def _forget_damaged_shards(out: Path, progress: bool) -> bool:
    """Verify every shard of a finished dataset; on damage, drop the manifest and the records
    from the first bad shard on, so the writer redoes exactly those. Returns True on damage."""
    manifest = Manifest.load(out)
    damaged = False
    for name, records in manifest.splits.items():
        for k, rec in enumerate(
            tqdm(records, desc=f"verifying {name}", leave=False, disable=not progress)
        ):
            problem = _shard_problem(out, rec)
            if problem:
                log.warning("%s; rewriting %s shards from %d on", problem, name, k)
                for later in range(k, len(records)):
                    (out / name / f"{later:05d}.json").unlink(missing_ok=True)
                damaged = True
                break
    if damaged:  # the manifest goes; its tokenizer identity stays in prepare.json
        remember_tokenizer(out, manifest.tokenizer)
        (out / MANIFEST).unlink()
    return damaged


def _shard_problem(out: Path, rec) -> str | None:
    for rel, checksum in ((rec.bin, rec.checksum), (rec.idx, rec.idx_checksum)):
        path = out / rel
        if not path.is_file():
            return f"{path} is missing"
        if file_checksum(path) != checksum:
            return f"{path} does not match its checksum"
    return None


def _obtain_tokenizer(cfg: PrepareConfig, out: Path, source: Source, split: Assigner) -> Tokenizer:
    """The dataset's own copy in `out/tokenizer` (made on first run: trained, or copied)."""
    directory = out / "tokenizer"
    if (directory / META_FILE).is_file():
        expected = recorded_tokenizer(out)
        if expected is None:  # prepared before identities were recorded: record it now
            tokenizer = load_tokenizer(directory)
            remember_tokenizer(out, tokenizer.identity)
            return tokenizer
        return load_verified_tokenizer(directory, expected, f"the dataset in {out}")
    if cfg.tokenizer == "train":
        token_dtype(cfg.token_dtype, cfg.vocab_size)  # before spending the training time
        log.info("training a %d-token BPE on %s", cfg.vocab_size, cfg.source)
        texts = _training_texts(cfg, source, split)
        tokenizer = train_bpe(texts, cfg.vocab_size, name=out.name, progress=cfg.progress)
    else:
        tokenizer = load_tokenizer(cfg.tokenizer)
    token_dtype(cfg.token_dtype, tokenizer.vocab_size)  # fail before saving anything
    tokenizer.save(directory)
    remember_tokenizer(out, tokenizer.identity)
    log.info("tokenizer %s saved in %s", tokenizer, directory)
    return tokenizer


def _training_texts(cfg: PrepareConfig, source: Source, split: Assigner) -> Iterator[str]:
    """Training-split text only, up to `tokenizer_train_chars` characters."""
    budget = cfg.tokenizer_train_chars
    total = _bpe_input_bound(cfg, source)
    bar = tqdm(
        total=total, unit="char", unit_scale=True, desc="BPE input", disable=not cfg.progress
    )
    for doc in split.documents(source):
        if budget <= 0:
            break
        if split(doc) == "train":
            text = doc.text[:budget]
            budget -= len(text)
            bar.update(len(text))
            yield text
    bar.total = bar.n  # the bound counts validation text and bytes: end the bar at what was read
    bar.close()


def _bpe_input_bound(cfg: PrepareConfig, source: Source) -> int | None:
    """At most what BPE training reads: the character cap, or a smaller corpus of text files
    (their bytes bound their characters); None (a bar without a total) when the size is unknown,
    rather than the cap: a 6 MB corpus read against a 1e9-character cap looks stuck at 1%."""
    known = source.kind in ("text", "stdlib") and not cfg.max_documents
    if not known or source.total_bytes is None:
        return None
    return min(cfg.tokenizer_train_chars, source.total_bytes)


def _limited(docs: Iterator[Document], max_documents: int) -> Iterator[Document]:
    return itertools.takewhile(lambda d: d.index < max_documents, docs) if max_documents else docs


def _tokenize_source(
    cfg: PrepareConfig,
    source: Source,
    split: Assigner,
    writers: dict[str, ShardWriter],
    pool: EncodePool,
) -> int:
    """Encode every document the writers still want; returns the index after the last one."""
    total = source.total_bytes if source.kind in ("text", "stdlib") else None
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", disable=not cfg.progress)
    seen = {"docs": 0, "end": 0}
    counts = {"docs": 0, "tokens": 0}
    start = time.perf_counter()

    def batches() -> Iterator[tuple[tuple[str, list[int]], list[str]]]:
        pending = {name: ([], [], 0) for name in SPLITS}
        for doc in split.documents(source):
            seen["docs"] += 1
            seen["end"] = doc.index + 1
            name = split(doc)
            if not writers[name].wants(doc.index):
                bar.update(len(doc.text.encode("utf-8", errors="surrogatepass")))
                continue
            indices, texts, chars = pending[name]
            indices.append(doc.index)
            texts.append(doc.text)
            chars += len(doc.text)
            pending[name] = (indices, texts, chars)
            if chars >= BATCH_CHARS or len(texts) >= BATCH_DOCS:
                yield (name, indices), texts
                pending[name] = ([], [], 0)
        for name, (indices, texts, _) in pending.items():
            if texts:
                yield (name, indices), texts

    for (name, indices), enc in pool.map(batches()):
        bounds = np.concatenate([[0], np.cumsum(enc.lengths)])
        for i, index in enumerate(indices):
            writers[name].append(index, enc.tokens[bounds[i] : bounds[i + 1]])
        counts["docs"] += len(indices)
        counts["tokens"] += int(bounds[-1])
        bar.update(enc.text_bytes)
        bar.set_postfix(docs=counts["docs"], tokens=counts["tokens"], refresh=False)
    bar.close()
    if seen["docs"] == 0:
        report = source.report
        raise DataError(
            f"source={cfg.source} has no documents ({report.files} files, "
            f"{report.skipped_count} skipped, {report.empty} empty)"
        )
    elapsed = time.perf_counter() - start
    log.info(
        "tokenized %d documents into %d tokens in %.1f s (%d threads)",
        counts["docs"],
        counts["tokens"],
        elapsed,
        pool.workers,
    )
    return seen["end"]


def _configure_logging(out: Path) -> None:
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(fmt)
    _make_dir(out)
    logfile = logging.FileHandler(out / "prepare.log")
    logfile.setFormatter(fmt)
    root = logging.getLogger()
    root.handlers[:] = [console, logfile]
    root.setLevel(logging.INFO)


def run(cfg: PrepareConfig) -> int:
    """The command: prepare, log to the console and `out/prepare.log`, exit 1 on bad input."""
    try:
        _configure_logging(cfg.output_dir())
        prepare(cfg)
    except DataError as err:
        log.error("%s", err)
        return 1
    except OSError as err:
        if not is_disk_full(err):
            raise
        log.error(
            "no space left on the device of %s: the finished shards are kept; free space and run "
            "the same command again to continue",
            err.filename or cfg.output_dir(),
        )
        return 1
    except KeyboardInterrupt:
        log.error("interrupted: finished shards are kept; re-run the same command to continue")
        return 130
    return 0


CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
ConfigStore.instance().store(name="prepare_schema", node=PrepareConfig)


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="prepare")
def main(cfg: DictConfig) -> None:
    try:
        settings = OmegaConf.to_object(cfg)
    except DataError as err:  # a rule in PrepareConfig.__post_init__
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    sys.exit(run(settings))


if __name__ == "__main__":
    main()
