"""The O(1)-memory permutation: a bijection for every n, seeded, and close to uniform."""

from __future__ import annotations

import numpy as np
import pytest

from data.permutation import IndexPermutation


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 64, 100, 1000, 4097, 65536, 100_003])
def test_it_is_a_bijection_on_the_range(n):
    out = IndexPermutation(n, seed=0)(np.arange(n))
    assert out.min() >= 0 and out.max() < n
    assert np.array_equal(np.sort(out), np.arange(n))


def test_it_is_deterministic_and_depends_on_seed_and_epoch():
    n = 5000
    base = IndexPermutation(n, seed=3, epoch=0)(np.arange(n))
    assert np.array_equal(base, IndexPermutation(n, seed=3, epoch=0)(np.arange(n)))
    assert not np.array_equal(base, IndexPermutation(n, seed=4, epoch=0)(np.arange(n)))
    assert not np.array_equal(base, IndexPermutation(n, seed=3, epoch=1)(np.arange(n)))
    # known values pin the order across machines and numpy versions
    assert IndexPermutation(10, seed=0)(np.arange(10)).tolist() == [0, 5, 3, 7, 6, 1, 9, 8, 4, 2]


def test_any_subset_of_indices_maps_like_the_whole():
    perm = IndexPermutation(10**6, seed=1)
    picks = np.array([999_999, 0, 123_456, 7])
    whole = perm(np.arange(10**6))
    assert np.array_equal(perm(picks), whole[picks])


def test_positions_are_close_to_uniform():
    """Where index 0 lands over 4000 seeds: a chi-square test against uniform on 16 slots
    (critical value 37.7 for 15 degrees of freedom at p = 0.001)."""
    n, seeds = 16, 4000
    landed = np.array([IndexPermutation(n, seed=s)(np.array([0]))[0] for s in range(seeds)])
    counts = np.bincount(landed, minlength=n)
    expected = seeds / n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 37.7


def test_neighbours_are_scattered():
    """Consecutive indices should not stay together (what a shuffle is for)."""
    out = IndexPermutation(100_000, seed=0)(np.arange(1000))
    assert np.median(np.abs(np.diff(out))) > 10_000


def test_out_of_range_and_empty():
    with pytest.raises(IndexError):
        IndexPermutation(10, seed=0)(np.array([10]))
    with pytest.raises(ValueError, match="empty range"):
        IndexPermutation(0, seed=0)
