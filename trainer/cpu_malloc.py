"""CPU runs: keep freed memory in the process for the next step instead of returning it.

glibc serves a large allocation with fresh pages from mmap and unmaps them on free (above its
mmap threshold: 128 KiB, adapting up to 32 MiB). A training step allocates the same large
activations and gradients every step, so on CPU each of them is a new mapping whose pages the
kernel faults in and zeroes again: copying a 33 MB tensor took 13 ms with fresh pages and 3 ms
with reused ones, and the tiny model's 8 x 256 training step got 9-12% faster (bench/
default_speed.py). Raising the mmap and trim thresholds makes glibc serve those blocks from its
heap and keep freed ones for reuse, what a GPU caching allocator does for device memory. The
process's peak resident memory stayed the same (938 vs 954 MB over 33 steps of that model).

Not glibc (macOS, musl), or a non-CPU run: nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

KEEP_BELOW_BYTES = 1 << 30  # blocks up to 1 GiB come from the heap and are kept when freed
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (glibc's malloc.h)


def keep_freed_memory() -> str:
    """Set glibc's thresholds so freed blocks below KEEP_BELOW_BYTES stay in the process.
    Returns what was done, in words (for the run log)."""
    if platform.libc_ver()[0] != "glibc":
        return "the system allocator (not glibc: nothing to set)"
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    done = libc.mallopt(M_MMAP_THRESHOLD, KEEP_BELOW_BYTES) == 1
    done = done and libc.mallopt(M_TRIM_THRESHOLD, KEEP_BELOW_BYTES) == 1
    if not done:
        return "glibc's defaults (mallopt refused the thresholds)"
    return (
        f"glibc keeps freed blocks up to {KEEP_BELOW_BYTES >> 20} MiB for reuse "
        "(trainer.cpu_malloc=system for its defaults)"
    )
