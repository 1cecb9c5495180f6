"""trainer.cpu_malloc=keep: freed large blocks are reused without new page faults (counted by
the kernel, not timed), in a fresh process so the test's own allocator is untouched."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="machine: glibc only")

# Allocate, write and free a 64 MiB tensor until the heap settles (torch's 64-byte aligned blocks
# do not fit the first freed ones exactly: glibc grows the heap a few times first, as in a
# training run's first steps), then count the minor page faults of doing it once more: fresh
# mmap pages fault once per 4 KiB page (~16k), kept ones do not.
PROBE = """
import resource, sys, torch
from trainer import cpu_malloc
size = 64 << 20
if sys.argv[1] == "keep":
    print(cpu_malloc.keep_freed_memory(), file=sys.stderr)
    size = min(size, cpu_malloc.kept_below_bytes // 2)  # an older glibc keeps up to 32 MiB
def touch():
    t = torch.empty(size, dtype=torch.uint8)
    t.fill_(1)
    del t
for _ in range(16):
    touch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touch()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, size // 4096)
"""


def faults(mode: str) -> tuple[int, int]:
    """(minor page faults of one more allocate-write-free, 4 KiB pages in the block)."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
    )
    counted, pages = out.stdout.split()
    return int(counted), int(pages)


def test_kept_blocks_are_reused_without_page_faults():
    counted, pages = faults("system")
    assert counted > pages // 2  # glibc's default: a 64 MiB block is mapped afresh
    counted, pages = faults("keep")
    assert pages > 1000 and counted < pages // 20  # kept in the heap: no new pages to fault in
