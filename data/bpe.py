"""Training a byte-level BPE with rustbpe and turning it into a tiktoken `Tokenizer`.

rustbpe learns merges over pre-split chunks (the GPT-4 split pattern by default) on all cores;
its ranks load unchanged into `tiktoken.Encoding`, which does the encoding everywhere else. The
special tokens take the ids right after the learned ranks, so `vocab_size` counts them too.
rustbpe's own log (a line per percent of the merges) is replaced by one progress bar.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import rustbpe
from tqdm import tqdm

from data.errors import DataError
from data.tokenizer import EOT, GPT4_SPLIT_PATTERN, Tokenizer

log = logging.getLogger(__name__)
BYTE_TOKENS = 256
RUSTBPE_LOGGER = "rustbpe"  # the Python logger its Rust `log` records arrive on (pyo3-log)
MERGE_PROGRESS = re.compile(r"\((\d+)/(\d+) merges\)")


def train_bpe(
    texts: Iterable[str],
    vocab_size: int,
    *,
    name: str = "bpe",
    pattern: str = GPT4_SPLIT_PATTERN,
    special_tokens: tuple[str, ...] = (EOT,),
    progress: bool = False,
) -> Tokenizer:
    """Learn `vocab_size - len(special_tokens) - 256` merges from `texts` (streamed once);
    `progress` shows a bar of the merges."""
    if EOT not in special_tokens:
        raise DataError(f"special_tokens={special_tokens} must include {EOT}")
    smallest = BYTE_TOKENS + len(special_tokens)
    if vocab_size < smallest + 1:
        raise DataError(
            f"vocab_size={vocab_size} leaves no room for merges: 256 byte tokens + "
            f"{len(special_tokens)} special tokens already take {smallest}; use a larger value"
        )
    trainer = rustbpe.Tokenizer()
    start = time.perf_counter()
    with _rustbpe_log_as_progress(progress):
        trainer.train_from_iterator(iter(texts), vocab_size - len(special_tokens), pattern=pattern)
    ranks = dict(trainer.get_mergeable_ranks())
    learned = len(ranks)
    log.info("learned %d BPE merges in %.1f s", learned - BYTE_TOKENS, time.perf_counter() - start)
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


class _MergeBar(logging.Handler):
    """Takes rustbpe's log records: its "Progress: ... (k/n merges)" lines move one progress bar
    (when enabled), everything else it says is dropped (our own lines say what was done)."""

    def __init__(self, enabled: bool):
        super().__init__(logging.INFO)
        self.enabled = enabled
        self.bar: tqdm | None = None

    def emit(self, record: logging.LogRecord) -> None:
        found = MERGE_PROGRESS.search(record.getMessage())
        if not self.enabled or found is None:
            return
        done, total = int(found[1]), int(found[2])
        if self.bar is None:
            self.bar = tqdm(total=total, desc="BPE merges", unit="merge", unit_scale=True)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        super().close()


@contextmanager
def _rustbpe_log_as_progress(progress: bool) -> Iterator[None]:
    """rustbpe logs at INFO a line per percent of the merges; while it trains, its logger feeds
    `_MergeBar` alone (no propagation to the console or prepare.log), then is restored."""
    logger = logging.getLogger(RUSTBPE_LOGGER)
    saved = (logger.handlers[:], logger.propagate, logger.level)
    handler = _MergeBar(progress)
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.handlers[:], logger.propagate = saved[0], saved[1]
        logger.setLevel(saved[2])
        handler.close()
