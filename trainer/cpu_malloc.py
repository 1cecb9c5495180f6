"""CPU runs: keep freed memory in the process for the next step instead of returning it.

glibc serves a large allocation with fresh pages from mmap and unmaps them on free (above its
mmap threshold: 128 KiB, adapting up to 32 MiB). A training step allocates the same large
activations and gradients every step, so on CPU each block above that threshold is a new mapping
whose pages the kernel faults in and zeroes again (a 33 MB copy took 13 ms on fresh pages and 3
ms on reused ones, timed by hand on the issue-21 machine). Raising the mmap and trim thresholds makes glibc serve those
blocks from its heap and keep freed ones for reuse, what a GPU caching allocator does for device
memory (bench/default_speed.py and bench/moe_layer.py measure it, see the README):
- the tiny default model gains nothing measurable (its largest blocks, the 512-token loss chunks
  of 16 MiB, already stay under glibc's adaptive threshold) and holds 8% more peak memory;
- transformers' step on the same model (whole (2048, 8192) fp32 logits) runs 10% faster, the MoE
  layer and dense FFN of bench/moe_layer.py (4096 tokens) 16-21%.

Older glibc refuses an mmap threshold above 32 MiB: then 32 MiB is used. Not glibc (macOS,
musl): nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

KEEP_BELOW_BYTES = 1 << 30  # blocks up to 1 GiB come from the heap and are kept when freed
OLD_GLIBC_MAX_BYTES = 32 << 20  # the largest mmap threshold glibc before 2.35-ish accepts
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (glibc's malloc.h)

kept_below_bytes = 0  # the threshold in effect after keep_freed_memory (0: none set)


def keep_freed_memory() -> str:
    """Set glibc's thresholds so freed blocks below KEEP_BELOW_BYTES (or the most an older glibc
    accepts) stay in the process. Returns what was done, in words (for the run log)."""
    global kept_below_bytes
    if platform.libc_ver()[0] != "glibc":
        return "the system allocator (not glibc: nothing to set)"
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    for limit in (KEEP_BELOW_BYTES, OLD_GLIBC_MAX_BYTES):
        if libc.mallopt(M_MMAP_THRESHOLD, limit) == 1:
            libc.mallopt(M_TRIM_THRESHOLD, limit)
            kept_below_bytes = limit
            return (
                f"glibc keeps freed blocks up to {limit >> 20} MiB for reuse "
                "(trainer.cpu_malloc=system for its defaults)"
            )
    return "glibc's defaults (mallopt refused the thresholds)"
