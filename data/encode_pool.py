"""Parallel tokenization: batches of documents encoded by threads, results in order.

tiktoken encodes in Rust with the GIL released, so threads scale across cores the way its own
`encode_ordinary_batch` does, without the start-up of worker processes (0.4-0.6 s of spawn,
imports and tokenizer loading: a third of a 30 MB job, bench/prepare_throughput.py) or pickling
texts and tokens across a process boundary. Each document is encoded straight into a numpy
buffer (`Tokenizer.encode_ordinary_array`), so no Python list of token ints is built. At most
`2 * workers + 2` batches are in flight, which bounds memory however large the source is, and
results come back in submission order so shards are deterministic. With one worker everything
runs in the calling thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from data.tokenizer import Tokenizer


class Encoded(NamedTuple):
    tokens: np.ndarray  # (sum of lengths,) in the shard dtype, EOT after every document
    lengths: np.ndarray  # (documents,) int64
    text_bytes: int  # UTF-8 bytes of the batch's text (for throughput)


def encode_batch(tokenizer: Tokenizer, texts: list[str], dtype: np.dtype) -> Encoded:
    """Every text's tokens followed by EOT, concatenated in `dtype`."""
    eot = np.array([tokenizer.eot_id], dtype=np.uint32)
    lengths = np.empty(len(texts), dtype=np.int64)
    pieces = []
    for i, text in enumerate(texts):
        ids = tokenizer.encode_ordinary_array(text)  # (n,) uint32
        lengths[i] = len(ids) + 1
        pieces += (ids, eot)
    tokens = np.concatenate(pieces).astype(dtype, copy=False) if pieces else np.empty(0, dtype)
    nbytes = sum(len(t.encode("utf-8", errors="surrogatepass")) for t in texts)
    return Encoded(tokens, lengths, nbytes)


class EncodePool:
    """Threads that encode batches; `map` yields results in submission order.

    `start(tokenizer, dtype)` fixes what `map` uses; the tokenizer is shared by the threads
    (a tiktoken encoding is safe to use from several at once).
    """

    def __init__(self, workers: int):
        self.workers = workers
        self._executor = ThreadPoolExecutor(workers) if workers > 1 else None
        self._tokenizer: Tokenizer | None = None
        self._dtype = np.dtype(np.uint32)

    def start(self, tokenizer: Tokenizer, dtype: np.dtype) -> None:
        self._tokenizer, self._dtype = tokenizer, np.dtype(dtype)

    def map(self, items: Iterable[tuple[Any, list[str]]]) -> Iterator[tuple[Any, Encoded]]:
        if self._tokenizer is None:
            raise RuntimeError("EncodePool.map before start(tokenizer, dtype)")
        if self._executor is None:
            for tag, texts in items:
                yield tag, encode_batch(self._tokenizer, texts, self._dtype)
            return
        in_flight: deque[tuple[Any, Future]] = deque()
        for tag, texts in items:
            task = self._executor.submit(encode_batch, self._tokenizer, texts, self._dtype)
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
