"""Training a byte-level BPE with rustbpe and turning it into a tiktoken `Tokenizer`.

rustbpe learns merges over pre-split chunks (the GPT-4 split pattern by default) on all cores;
its ranks load unchanged into `tiktoken.Encoding`, which does the encoding everywhere else. The
special tokens take the ids right after the learned ranks, so `vocab_size` counts them too.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import rustbpe

from data.errors import DataError
from data.tokenizer import EOT, GPT4_SPLIT_PATTERN, Tokenizer

log = logging.getLogger(__name__)
BYTE_TOKENS = 256


def train_bpe(
    texts: Iterable[str],
    vocab_size: int,
    *,
    name: str = "bpe",
    pattern: str = GPT4_SPLIT_PATTERN,
    special_tokens: tuple[str, ...] = (EOT,),
) -> Tokenizer:
    """Learn `vocab_size - len(special_tokens) - 256` merges from `texts` (streamed once)."""
    if EOT not in special_tokens:
        raise DataError(f"special_tokens={special_tokens} must include {EOT}")
    smallest = BYTE_TOKENS + len(special_tokens)
    if vocab_size < smallest + 1:
        raise DataError(
            f"vocab_size={vocab_size} leaves no room for merges: 256 byte tokens + "
            f"{len(special_tokens)} special tokens already take {smallest}; use a larger value"
        )
    trainer = rustbpe.Tokenizer()
    trainer.train_from_iterator(iter(texts), vocab_size - len(special_tokens), pattern=pattern)
    ranks = dict(trainer.get_mergeable_ranks())
    learned = len(ranks)
    if learned == BYTE_TOKENS:
        raise DataError("the BPE training corpus is empty: no text reached the trainer")
    if learned < vocab_size - len(special_tokens):
        log.warning(
            "the corpus supports only %d merges; the vocabulary is %d, not vocab_size=%d",
            learned - BYTE_TOKENS,
            learned + len(special_tokens),
            vocab_size,
        )
    special = {tok: learned + i for i, tok in enumerate(special_tokens)}
    return Tokenizer(name, pattern, ranks, special)
