"""Engram's addressing: which table rows the n-grams ending at each token read, in int64
(the rule of deepseek-ai/Engram: engram_demo_v1.py::NgramHashMapping, written for torch).

Shapes: B batch, T tokens, N = max_ngram, O = N - 1 orders (n = 2..N), K heads per order.

For Engram layer l (0-based block index):
  multipliers  m_k = 2 r_k + 1, k = 0..N-1, r = numpy default_rng(seed + 10007 l).integers(0,
               max(1, (int64max // V') // 2), N): odd, and small enough that one product x m_k
               cannot overflow (V' = the vocabulary size after compression)
  mix_n(t)     (x_t m_0) XOR (x_{t-1} m_1) XOR ... XOR (x_{t-n+1} m_{n-1}), int64 (products wrap,
               as numpy's do); x_{t-k} is pad_id where t - k lies before the token's document
  row          mix_n(t) mod p_{n,j} for head j of order n (Python's sign rule: never negative)
The primes p are the smallest unused primes >= each order's table size, taken head after head,
order after order, layer after layer in increasing layer order: distinct across all of them, so
no two heads share a hash function's collisions.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

INT64_MAX = np.iinfo(np.int64).max
LAYER_SEED_STRIDE = 10007  # the demo's PRIME_1
_WITNESSES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # exact for n < 3.3e24


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin (exact for every n below 3.3e24, far beyond any table)."""
    if n < 2:
        return False
    for p in _WITNESSES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in _WITNESSES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def table_primes(layers: list[int], sizes: list[int], heads: int) -> dict[int, list[list[int]]]:
    """Layer -> per order (n = 2..N) the K primes sizing its heads' tables (see the module
    docstring); `sizes[n - 2]` is order n's least table size."""
    seen: set[int] = set()
    out: dict[int, list[list[int]]] = {}
    for layer in sorted(layers):
        per_order = []
        for size in sizes:
            primes, candidate = [], size - 1
            for _ in range(heads):
                candidate += 1
                while not is_prime(candidate) or candidate in seen:
                    candidate += 1
                seen.add(candidate)
                primes.append(candidate)
            per_order.append(primes)
        out[layer] = per_order
    return out


def layer_multipliers(seed: int, layer: int, max_ngram: int, vocab: int) -> list[int]:
    """The N odd multipliers of one layer (see the module docstring); `vocab` is V'."""
    half_bound = max(1, int(INT64_MAX // vocab) // 2)
    rng = np.random.default_rng(int(seed + LAYER_SEED_STRIDE * layer))
    r = rng.integers(low=0, high=half_bound, size=(max_ngram,), dtype=np.int64)
    return [int(v) for v in r * 2 + 1]


def shifted_tokens(
    ids: Tensor, positions: Tensor, history: Tensor | None, max_ngram: int, pad: int | Tensor
) -> list[Tensor]:
    """[x_t, x_{t-1}, ..., x_{t-N+1}], each (B, T) int64: the token k steps back in the same
    document, else `pad`. ids (B, T); positions (B, T), each token's index in its document (or in
    the sequence the cache continues); history (B, N-1): the N-1 tokens before ids (generation),
    or None (the row starts here); pad: an int or a 0-d tensor (no host sync under compile)."""
    B, T = ids.shape
    pad = torch.as_tensor(pad, dtype=ids.dtype, device=ids.device)
    if history is None:
        history = pad.expand(B, max_ngram - 1)
    extended = torch.cat([history, ids], dim=1)  # (B, N-1+T)
    start = max_ngram - 1
    out = [ids]
    for k in range(1, max_ngram):
        back = extended[:, start - k : start - k + T]
        out.append(torch.where(positions >= k, back, pad))
    return out


def ngram_rows(shifted: list[Tensor], multipliers: Tensor, primes: Tensor) -> Tensor:
    """Each head's row within its own table: (B, T, O K) int64, order-major (order 2's K heads,
    then order 3's, ...). shifted: from `shifted_tokens`; multipliers (N,); primes (O, K)."""
    mix = shifted[0] * multipliers[0]
    rows = []
    for k in range(1, len(shifted)):
        mix = torch.bitwise_xor(mix, shifted[k] * multipliers[k])  # order k + 1
        rows.append(torch.remainder(mix[..., None], primes[k - 1]))  # (B, T, K)
    return torch.cat(rows, dim=-1)
