"""Parallel tokenization: batches of documents encoded by worker processes, results in order.

Each worker loads the tokenizer once (by the spec it is given) and returns a batch as one flat
token array plus per-document lengths, already in the shard dtype, so little
crosses the process boundary. At most `2 * workers + 2` batches are in flight, which bounds memory
however large the source is, and results come back in submission order so shards are
deterministic. With one worker everything runs in the calling process.
"""

from __future__ import annotations

import multiprocessing
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from data.tokenizer import Tokenizer, load_tokenizer

_worker_tokenizers: dict[str, Tokenizer] = {}  # per worker process: spec -> tokenizer


class Encoded(NamedTuple):
    tokens: np.ndarray  # (sum of lengths,) in the shard dtype, EOT after every document
    lengths: np.ndarray  # (documents,) int64
    text_bytes: int  # UTF-8 bytes of the batch's text (for throughput)


def _worker_tokenizer(spec: str) -> Tokenizer:
    if spec not in _worker_tokenizers:
        _worker_tokenizers[spec] = load_tokenizer(spec)
    return _worker_tokenizers[spec]


def _warm_up(spec: str) -> None:
    """Runs first in each worker: imports (and, when known, the tokenizer) load while the main
    process is still busy with its own start-up."""
    if spec:
        _worker_tokenizer(spec)


def _encode_in_worker(spec: str, dtype: str, texts: list[str]) -> Encoded:
    return encode_batch(_worker_tokenizer(spec), texts, np.dtype(dtype))


def encode_batch(tokenizer: Tokenizer, texts: list[str], dtype: np.dtype) -> Encoded:
    encode, eot = tokenizer.encode_ordinary, tokenizer.eot_id
    lengths = np.empty(len(texts), dtype=np.int64)
    pieces = []
    for i, text in enumerate(texts):
        ids = encode(text)
        ids.append(eot)
        lengths[i] = len(ids)
        pieces.append(np.array(ids, dtype=dtype))
    tokens = np.concatenate(pieces) if pieces else np.empty(0, dtype=dtype)
    nbytes = sum(len(t.encode("utf-8", errors="surrogatepass")) for t in texts)
    return Encoded(tokens, lengths, nbytes)


class EncodePool:
    """Worker processes that encode batches; `map` yields results in submission order.

    Create it early and call `warm_up(spec)`: spawning the workers and loading the tokenizer then
    overlap with the caller's own start-up. `start(spec, dtype)` fixes what `map` uses.
    """

    def __init__(self, workers: int):
        self.workers = workers
        self._executor: ProcessPoolExecutor | None = None
        self._spec, self._dtype = "", np.dtype(np.uint32)
        if workers > 1:
            self._executor = ProcessPoolExecutor(
                max_workers=workers,
                # spawn: the caller may have torch or threads loaded, which fork does not survive
                mp_context=multiprocessing.get_context("spawn"),
            )

    def warm_up(self, spec: str = "") -> None:
        if self._executor is not None:
            for _ in range(self.workers):
                self._executor.submit(_warm_up, spec)

    def start(self, spec: str | Path, dtype: np.dtype) -> None:
        self._spec, self._dtype = str(spec), np.dtype(dtype)
        if self._executor is None:
            self._tokenizer = load_tokenizer(self._spec)

    def map(self, items: Iterable[tuple[Any, list[str]]]) -> Iterator[tuple[Any, Encoded]]:
        if self._executor is None:
            for tag, texts in items:
                yield tag, encode_batch(self._tokenizer, texts, self._dtype)
            return
        in_flight: deque[tuple[Any, Future]] = deque()
        for tag, texts in items:
            task = self._executor.submit(_encode_in_worker, self._spec, self._dtype.str, texts)
            in_flight.append((tag, task))
            if len(in_flight) >= 2 * self.workers + 2:
                done_tag, fut = in_flight.popleft()
                yield done_tag, fut.result()
        while in_flight:
            done_tag, fut = in_flight.popleft()
            yield done_tag, fut.result()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> EncodePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
