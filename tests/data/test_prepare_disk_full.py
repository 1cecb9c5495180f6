"""`python -m data.prepare` on a disk that fills up: one line that says the finished shards are
kept and how to continue, no traceback (issue 13, item 17)."""

from __future__ import annotations

import sys

import pytest

from tests.commands import can_mount_tmpfs, run_on_tmpfs
from tests.data.helpers import write_corpus

pytestmark = pytest.mark.integration


@pytest.mark.skipif(not can_mount_tmpfs(), reason="needs unshare and a user namespace for tmpfs")
def test_a_full_disk_while_preparing_is_one_line(tokenizer_dir, tmp_path):
    corpus = write_corpus(tmp_path / "corpus", files=400)[0].parent  # about 1 MiB of tokens
    disk = tmp_path / "disk"
    disk.mkdir()
    args = [f"source={corpus}", f"out={disk / 'out'}", f"tokenizer={tokenizer_dir}"]
    args += ["shard_tokens=20000", "workers=1", "progress=false", "token_dtype=uint32"]
    command = " ".join(f"'{a}'" for a in args)
    result = run_on_tmpfs(
        disk, "size=256k", f"exec {sys.executable} -m data.prepare {command}", tmp_path
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "no space left on the device" in result.stderr, result.stderr[-3000:]
    assert "the finished shards are kept" in result.stderr
    assert "Traceback" not in result.stderr
