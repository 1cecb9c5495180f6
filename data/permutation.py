"""A seeded permutation of [0, n) evaluated per index, in O(1) memory, for any n.

A stored permutation of every training window costs 8 bytes a window (gigabytes for a
trillion-token corpus, in every process). Instead, a balanced Feistel network over the smallest
even-bit domain 2^b >= n is a bijection on [0, 2^b); "cycle walking" (apply it again while the
result is >= n) restricts it to a bijection on [0, n). Since 2^b < 4n, a walk takes fewer than
four steps on average. Round keys come from numpy's SeedSequence, so the order is the same on
every machine and in every process.
"""

from __future__ import annotations

import numpy as np

ROUNDS = 6
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a cheap, well-mixing 64-bit hash (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


class IndexPermutation:
    """`perm(indices)` maps an int array of positions in [0, n) to distinct positions in [0, n)."""

    def __init__(self, n: int, seed: int, epoch: int = 0):
        if n < 1:
            raise ValueError(f"cannot permute an empty range (n={n})")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        bits += bits % 2
        self.half = np.uint64(bits // 2)
        self.mask = np.uint64((1 << (bits // 2)) - 1)
        state = np.random.SeedSequence([seed, epoch]).generate_state(ROUNDS, dtype=np.uint64)
        self.keys = [np.uint64(k) for k in state]

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & self.mask)
        return (left << self.half) | right

    def __call__(self, indices: np.ndarray) -> np.ndarray:
        x = np.asarray(indices, dtype=np.uint64)
        if x.size and int(x.max()) >= self.n:
            raise IndexError(f"index {int(x.max())} is outside [0, {self.n})")
        with np.errstate(over="ignore"):
            y = self._feistel(x)
            outside = y >= self.n
            while outside.any():
                y[outside] = self._feistel(y[outside])
                outside = y >= self.n
        return y.astype(np.int64)
