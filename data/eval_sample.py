"""Fixed evaluation samples: windows spread over a whole split, the same at every evaluation.

The split's N windows are cut into n equal strata and one window is drawn in each (seeded), so
every window is equally likely to be in the sample and every document contributes in
proportion to its length (within one window). When the split has no more windows than asked,
all of them are used (rounded down to whole global batches). The sample depends only on the
split, the window length, n and the seed: resuming, or another number of data-parallel ranks
(each takes its slice of every batch), evaluates exactly the same windows.

Used for the validation loss (the `val` split) and for `train_eval_loss` (a sample of the
training split, so over- and under-fitting show side by side).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from data.reader import SplitReader

SALT = {"val": 0x5EED_0001, "train": 0x5EED_0002}


def spread_sample(total: int, count: int, seed: int, salt: int) -> np.ndarray:
    """`count` sorted indices of [0, total), one drawn uniformly in each of `count` equal strata
    (all of [0, total) when count >= total)."""
    if count <= 0:
        return np.empty(0, dtype=np.int64)
    if count >= total:
        return np.arange(total, dtype=np.int64)
    rng = np.random.default_rng([seed, salt])
    bounds = (np.arange(count + 1, dtype=np.float64) * total / count).astype(np.int64)
    widths = np.maximum(bounds[1:] - bounds[:-1], 1)
    return bounds[:-1] + (rng.random(count) * widths).astype(np.int64)


@dataclass
class EvalSample:
    """The windows of one split that an evaluation reads, and what they cover."""

    split: str
    reader: SplitReader
    seq_len: int
    windows: np.ndarray  # (batches * global_batch,) sorted window indices
    batches: int
    split_windows: int  # windows in the whole split

    @classmethod
    def build(
        cls, reader: SplitReader, seq_len: int, batches: int, global_batch: int, seed: int
    ) -> EvalSample:
        total = reader.num_windows(seq_len)
        batches = min(batches, total // global_batch)
        count = batches * global_batch
        windows = spread_sample(total, count, seed, SALT[reader.split])
        return cls(reader.split, reader, seq_len, windows, batches, total)

    @property
    def tokens(self) -> int:
        return len(self.windows) * self.seq_len

    def documents_covered(self) -> int:
        """Distinct documents that the sampled windows' targets touch."""
        touched: set[int] = set()
        for w in self.windows:
            first = self.reader.document_at(int(w) * self.seq_len)
            last = self.reader.document_at(int(w) * self.seq_len + self.seq_len)
            touched.update(range(first, last + 1))
        return len(touched)

    def describe(self) -> dict[str, int]:
        """What an evaluation measures (logged, and in the evaluation rows of metrics.jsonl)."""
        return {
            "windows": len(self.windows),
            "tokens": self.tokens,
            "documents": self.documents_covered(),
            "split_documents": self.reader.documents,
            "split_windows": self.split_windows,
        }

    def rank_windows(self, rank: int, size: int) -> Iterator[np.ndarray]:
        """This rank's slice of every batch of the sample."""
        if not self.batches:
            return
        per_batch = len(self.windows) // self.batches
        local = per_batch // size
        for b in range(self.batches):
            first = b * per_batch + rank * local
            yield self.windows[first : first + local]
