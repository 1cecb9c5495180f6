"""Parallel tokenization: batches of documents encoded by worker processes, results in order.

Each worker loads the tokenizer once (from the dataset's own `tokenizer/` copy) and returns a
batch as one flat token array plus per-document lengths, already in the shard dtype, so little
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

_worker_state: dict[str, Any] = {}


class Encoded(NamedTuple):
    tokens: np.ndarray  # (sum of lengths,) in the shard dtype, EOT after every document
    lengths: np.ndarray  # (documents,) int64
    text_bytes: int  # UTF-8 bytes of the batch's text (for throughput)


def _init_worker(tokenizer_dir: str, dtype: str) -> None:
    _worker_state["tokenizer"] = load_tokenizer(tokenizer_dir)
    _worker_state["dtype"] = np.dtype(dtype)


def _encode_in_worker(texts: list[str]) -> Encoded:
    return encode_batch(_worker_state["tokenizer"], texts, _worker_state["dtype"])


def encode_batch(tokenizer: Tokenizer, texts: list[str], dtype: np.dtype) -> Encoded:
    encode, eot = tokenizer.encoding.encode_ordinary, tokenizer.eot_id
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
    """`map(items)`: items are (tag, texts); yields (tag, Encoded) in the same order."""

    def __init__(self, tokenizer_dir: Path, dtype: np.dtype, workers: int):
        self.workers = workers
        self._executor: ProcessPoolExecutor | None = None
        if workers > 1:
            self._executor = ProcessPoolExecutor(
                max_workers=workers,
                # spawn: the caller may have torch or threads loaded, which fork does not survive
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker,
                initargs=(str(tokenizer_dir), np.dtype(dtype).str),
            )
        else:
            self._tokenizer, self._dtype = load_tokenizer(tokenizer_dir), np.dtype(dtype)

    def map(self, items: Iterable[tuple[Any, list[str]]]) -> Iterator[tuple[Any, Encoded]]:
        if self._executor is None:
            for tag, texts in items:
                yield tag, encode_batch(self._tokenizer, texts, self._dtype)
            return
        in_flight: deque[tuple[Any, Future]] = deque()
        for tag, texts in items:
            in_flight.append((tag, self._executor.submit(_encode_in_worker, texts)))
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
