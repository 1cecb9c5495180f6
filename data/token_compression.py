"""Engram's tokenizer compression: a surjective map from token ids to canonical ids, so that
tokens differing only in case, accents, Unicode form or surrounding whitespace ("Hello",
" hello", "HELLO") hash to the same n-gram rows (deepseek-ai/Engram:
engram_demo_v1.py::CompressedTokenizer, about 23 % fewer ids on DeepSeek-V3's tokenizer).

A token's key is its text normalized by NFKC, NFD, dropping combining marks, lowercasing,
collapsing runs of [ \\t\\r\\n] to one space and stripping (a lone space stays a space); a token
whose bytes are not whole UTF-8 characters keeps its own key, as does one whose key would be
empty. Canonical ids are numbered in order of first appearance over the token ids, so the map
depends only on the tokenizer (deterministic); ids past the tokenizer's vocabulary (the model's
padding) each get a canonical id of their own after those.

The map is built at train start and saved in the run directory (`token_compression.json`); the
model also keeps it in its state, so checkpoints carry it.
"""

from __future__ import annotations

import json
import re
import unicodedata
from pathlib import Path

from data.atomic import atomic_write_json
from data.errors import DataError
from data.tokenizer import Tokenizer

FILE = "token_compression.json"
_WHITESPACE = re.compile(r"[ \t\r\n]+")


def normalize(text: str) -> str:
    """The demo's normalizer chain, with Python's unicodedata."""
    t = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    t = "".join(c for c in t if unicodedata.category(c) != "Mn").lower()
    t = _WHITESPACE.sub(" ", t)
    return t if t == " " else t.strip()


def token_key(tokenizer: Tokenizer, token_id: int) -> str | bytes:
    raw = tokenizer.encoding.decode_single_token_bytes(token_id)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw  # a piece of a character: its own canonical id
    return normalize(text) or text


def canonical_ids(tokenizer: Tokenizer, vocab_size: int) -> list[int]:
    """Token id -> canonical id for ids 0..vocab_size-1 (vocab_size >= the tokenizer's)."""
    if vocab_size < tokenizer.vocab_size:
        raise DataError(
            f"the model's vocabulary of {vocab_size} ids does not cover the tokenizer's "
            f"{tokenizer.vocab_size}"
        )
    known = set(tokenizer.ranks.values()) | set(tokenizer.special_tokens.values())
    first: dict[str | bytes, int] = {}
    out = []
    for token_id in range(tokenizer.vocab_size):
        key = token_key(tokenizer, token_id) if token_id in known else ("unused", token_id)
        out.append(first.setdefault(key, len(first)))
    n = len(first)
    out.extend(range(n, n + vocab_size - tokenizer.vocab_size))  # padding ids: one each
    return out


def save_or_check(run_dir: Path, tokenizer: Tokenizer, ids: list[int], write: bool) -> None:
    """Record the map in the run directory, or check it against the one recorded there (a run
    whose map changed would read other rows for the same n-grams)."""
    path = run_dir / FILE
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("canonical_ids") != ids:
            raise DataError(
                f"{path} records another token compression (tokenizer "
                f"{saved.get('tokenizer', {}).get('name')!r}) than the one built now from "
                f"{tokenizer.identity.short()}: the tokenizer or model.vocab_size changed. Train "
                "with the original ones, or start a new run directory"
            )
        return
    if write:
        atomic_write_json(
            path,
            {
                "tokenizer": tokenizer.identity.to_dict(),
                "canonical_vocab": max(ids) + 1,
                "canonical_ids": ids,
            },
        )
