"""Configs of the data package: preparation (`python -m data.prepare`) and the loader.

Both are kw_only dataclasses that validate themselves; `data.prepare` registers
`PrepareConfig` with Hydra and the trainer registers `LoaderConfig` under its `data` group.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from data.errors import DataError
from data.sources import DECODE_ERRORS

TOKEN_DTYPES = ("auto", "uint16", "uint32")
VERIFY_MODES = ("size", "lazy", "full")


@dataclass(kw_only=True)
class PrepareConfig:
    source: str = "stdlib"  # file | directory | glob | hf:<dataset or local dir> | stdlib
    out: str = ""  # output directory; "" = $LMFORGE_DATA_DIR (or ~/.cache/lmforge/data)/<name>
    tokenizer: str = "train"  # train | <tiktoken encoding name> | path/to/file.tiktoken | dir
    vocab_size: int = 8192  # size of a trained BPE, special tokens included
    tokenizer_train_chars: int = 1_000_000_000  # text fed to BPE training (training split only)
    text_column: str = "text"  # column holding the text (datasets and json/parquet/csv)
    hf_split: str = "train"  # split of an HF dataset
    hf_config: str | None = None  # configuration name of an HF dataset
    decode_errors: str = "skip"  # strict | skip | replace, for undecodable bytes
    include: str = "*"  # file-name pattern applied inside a directory source
    doc_separator: str = (
        ""  # text files: "" = a file is a document | blank_line | line | eot | <text>
    )
    val_fraction: float = 0.01  # documents held out for validation (by a seeded hash)
    split_seed: int = 0  # seeds the document-level train/validation split
    # few-document corpora (one input.txt): cut documents into pieces of about this many
    # characters and hold out val_fraction of the pieces (data.pieces); -1 = auto, 0 = never
    piece_chars: int = -1
    shard_tokens: int = 1 << 26  # tokens per shard (the last shard of a split is shorter)
    token_dtype: str = "auto"  # auto (uint16 when the vocabulary fits) | uint16 | uint32
    max_documents: int = 0  # stop after this many source documents; 0 = all
    workers: int = 0  # encoding threads; 0 = one per available core
    progress: bool = True  # progress bars (BPE input and merges, tokenizing, verifying)

    def __post_init__(self) -> None:
        if self.decode_errors not in DECODE_ERRORS:
            raise DataError(f"decode_errors={self.decode_errors} is not one of {DECODE_ERRORS}")
        if self.token_dtype not in TOKEN_DTYPES:
            raise DataError(f"token_dtype={self.token_dtype} is not one of {TOKEN_DTYPES}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise DataError(f"val_fraction={self.val_fraction} must be in [0, 1)")
        if not 1 <= self.shard_tokens < 1 << 40:
            raise DataError(f"shard_tokens={self.shard_tokens} must be in [1, 2**40)")
        if self.piece_chars < -1:
            raise DataError(f"piece_chars={self.piece_chars} must be -1 (auto), 0 (off) or > 0")
        for key in ("vocab_size", "tokenizer_train_chars", "max_documents", "workers"):
            if getattr(self, key) < 0:
                raise DataError(f"{key}={getattr(self, key)} must be >= 0")

    def output_dir(self) -> Path:
        if self.out:
            return Path(self.out).expanduser()
        base = Path(os.environ.get("LMFORGE_DATA_DIR", "~/.cache/lmforge/data")).expanduser()
        return base / default_dataset_name(self.source, self.tokenizer, self.vocab_size)

    def fingerprint(self) -> dict:
        """The settings that decide the bytes of the output (not where or how fast)."""
        keys = [
            "source",
            "tokenizer",
            "text_column",
            "hf_split",
            "hf_config",
            "decode_errors",
            "include",
            "doc_separator",
            "val_fraction",
            "split_seed",
            "piece_chars",
            "shard_tokens",
            "token_dtype",
            "max_documents",
        ]
        if self.tokenizer == "train":
            keys += ["vocab_size", "tokenizer_train_chars"]
        return {k: getattr(self, k) for k in keys} | {"source": self.resolved_source()}

    def resolved_source(self) -> str:
        """The source with a file path made absolute: `corpus/` and `/home/me/corpus/` are the
        same source, whichever directory the command runs in."""
        if self.source == "stdlib" or self.source.startswith("hf:"):
            return self.source
        return str(Path(self.source).expanduser().resolve())


def default_dataset_name(source: str, tokenizer: str, vocab_size: int) -> str:
    """`stdlib-py3.11-bpe8192`, `my_corpus-cl100k_base`, ...: readable and filesystem-safe."""
    if source == "stdlib":
        src = f"stdlib-py{sys.version_info.major}.{sys.version_info.minor}"
    else:
        src = Path(source.removeprefix("hf:").rstrip("/*")).name or "source"
    tok = f"bpe{vocab_size}" if tokenizer == "train" else Path(tokenizer).stem
    return re.sub(r"[^A-Za-z0-9._-]+", "_", f"{src}-{tok}")


@dataclass(kw_only=True)
class LoaderConfig:
    # dataset directory (with manifest.json); "" = the embedded default corpus (Python's standard
    # library), prepared with an 8192-token BPE on first use and cached
    path: str = ""
    seq_len: int = 256  # tokens per training sequence (each window holds seq_len + 1)
    shuffle: bool = True  # a seeded permutation of the windows per epoch (else in order)
    num_workers: int = 1  # background processes that assemble batches (0 = in the trainer)
    prefetch: int = 4  # batches each worker keeps ready
    verify: str = "lazy"  # size: sizes only | lazy: checksum a shard when first read | full
    val_batches: int = 8  # batches (of the global batch size) in one evaluation pass, sampled
    # over the whole validation split (all of it when it holds fewer)
    train_eval_batches: int = 2  # batches of a fixed training sample also evaluated (0 = off)

    def __post_init__(self) -> None:
        if self.seq_len < 1:
            raise DataError(f"data.seq_len={self.seq_len} must be >= 1")
        if self.verify not in VERIFY_MODES:
            raise DataError(f"data.verify={self.verify} is not one of {VERIFY_MODES}")
        if self.train_eval_batches < 0:
            raise DataError(f"data.train_eval_batches={self.train_eval_batches} must be >= 0")
        if self.num_workers < 0 or self.prefetch < 1 or self.val_batches < 0:
            raise DataError(
                f"data.num_workers={self.num_workers} must be >= 0, data.prefetch="
                f"{self.prefetch} >= 1 and data.val_batches={self.val_batches} >= 0"
            )
