"""Ranks agree on a checkpoint's verdict even when only one of them has a problem with it
(a read error on one node): every rank refuses it, for the reason that rank found (so rank 0's
log names it), and none hangs in a collective."""

from __future__ import annotations

import pytest

from tests.parallel.checkpoint_workers import one_rank_cannot_read
from tests.parallel.ranks import run_ranks

pytestmark = pytest.mark.distributed


def test_a_read_error_on_one_rank_is_the_verdict_of_every_rank(tmp_path):
    results = run_ranks(2, one_rank_cannot_read, str(tmp_path))
    assert [r["refused"] for r in results] == [True, True]
    for result in results:
        assert "cannot be read (Input/output error)" in result["message"]
