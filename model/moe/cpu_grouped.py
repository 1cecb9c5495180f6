"""A grouped GEMM for CPU that runs its groups in parallel, one intra-op thread each.

torch's CPU `_grouped_mm` (and a loop of `mm`) computes one group after another, each GEMM split
over all intra-op threads. A fine-grained expert's group is small (E=256 top-8 over 4096 tokens:
about 128 rows of C=512 by F=256) and splits badly: on a 2-core AVX2 CPU such a fp32 GEMM runs
1.3x faster on 2 threads than on 1, where a batched GEMM over the same (balanced) groups, which
gives each thread whole groups, runs 1.9x faster. Here the groups are cut into one contiguous
range per thread, with about equal rows in each, and every range runs its GEMMs single-threaded
(`torch.set_num_threads(1)` is per calling thread: OpenMP's and MKL's thread counts are
thread-local), the calling thread taking the first range and a pool the others. Every GEMM
is computed whole on one thread, so the result does not depend on the thread count (it can
differ in the last bits from a multi-threaded GEMM's).

Shapes: x (M, K) rows grouped in order, w (G, K, N), counts G ints summing to M -> (M, N).
Backward: dx[g] = dy[g] w[g]^T, dw[g] = x[g]^T dy[g], threaded the same way.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(workers, thread_name_prefix="lmforge-grouped-mm")


# a forked child (torchrun's workers, the tests' rank server) has none of the parent's threads
os.register_at_fork(after_in_child=_pool.cache_clear)


def thread_ranges(counts: Sequence[int], n_threads: int) -> list[tuple[int, int]]:
    """Contiguous group ranges [lo, hi), at most `n_threads`, each holding about M / n_threads
    rows (range t ends at the last group boundary within the first t shares of the rows)."""
    total = sum(counts)
    ranges, lo, done = [], 0, 0
    for t in range(1, n_threads):
        hi = lo
        while hi < len(counts) and done + counts[hi] <= total * t / n_threads:
            done += counts[hi]
            hi += 1
        if hi > lo:
            ranges.append((lo, hi))
            lo = hi
    if lo < len(counts):
        ranges.append((lo, len(counts)))
    return ranges


def _on_one_thread(work: Callable[[int, int], None], lo: int, hi: int, inference: bool) -> None:
    """work(lo, hi) with one intra-op thread, no autograd recording and no autocast, in the
    caller's inference mode (grad, autocast and inference modes are per thread: a pool
    thread's are the defaults; out= into an inference tensor needs inference mode)."""
    torch.set_num_threads(1)  # per thread (OpenMP's and MKL's counts), kept by the pool threads
    with (
        torch.inference_mode(inference),
        torch.no_grad(),
        torch.autocast("cpu", enabled=False),
    ):
        work(lo, hi)


def run_in_parallel(work: Callable[[int, int], None], ranges: list[tuple[int, int]]) -> None:
    """work(lo, hi) for every range on one thread each, the first on this thread, the rest on the
    pool (none when there is one range: it still runs single-threaded, so that every GEMM is
    computed alike whatever the thread count). This thread's intra-op thread count is restored
    last, after every range ended (torch also keeps it as the count new threads start with)."""
    if not ranges:
        return
    inference = torch.is_inference_mode_enabled()
    previous = torch.get_num_threads()
    try:
        pool = _pool(len(ranges) - 1) if len(ranges) > 1 else None
        futures = [pool.submit(_on_one_thread, work, lo, hi, inference) for lo, hi in ranges[1:]]
        try:
            _on_one_thread(work, *ranges[0], inference)
        finally:  # wait for every range, even when this one raised: they write into our buffers
            errors = [f.exception() for f in futures]
    finally:
        torch.set_num_threads(previous)
    for error in errors:
        if error is not None:
            raise error


def row_starts(counts: Sequence[int]) -> list[int]:
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    return starts


def _forward_mm(x: Tensor, w: Tensor, counts: Sequence[int], n_threads: int) -> Tensor:
    """y[g] = x[g] w[g]; (M, K), (G, K, N) -> (M, N)."""
    y = x.new_empty(x.shape[0], w.shape[2])
    starts = row_starts(counts)

    def work(lo: int, hi: int) -> None:
        for g in range(lo, hi):
            a, b = starts[g], starts[g + 1]
            torch.mm(x[a:b], w[g], out=y[a:b])

    run_in_parallel(work, thread_ranges(counts, n_threads))
    return y


def _backward_mm(
    x: Tensor, w: Tensor, dy: Tensor, counts: Sequence[int], n_threads: int, need: tuple[bool, bool]
) -> tuple[Tensor | None, Tensor | None]:
    """(dx, dw) = (dy[g] w[g]^T, x[g]^T dy[g]) per group; a group with no rows gets dw[g] = 0."""
    dx = torch.empty_like(x) if need[0] else None
    dw = torch.empty_like(w) if need[1] else None
    starts = row_starts(counts)

    def work(lo: int, hi: int) -> None:
        for g in range(lo, hi):
            a, b = starts[g], starts[g + 1]
            if dx is not None:
                torch.mm(dy[a:b], w[g].t(), out=dx[a:b])
            if dw is not None:
                torch.mm(x[a:b].t(), dy[a:b], out=dw[g])  # zero when the group is empty

    run_in_parallel(work, thread_ranges(counts, n_threads))
    return dx, dw


class _ThreadedGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, counts: tuple[int, ...], n_threads: int) -> Tensor:
        ctx.save_for_backward(x, w)
        ctx.counts, ctx.n_threads = counts, n_threads
        return _forward_mm(x, w, counts, n_threads)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        x, w = ctx.saved_tensors
        need = ctx.needs_input_grad[:2]
        dx, dw = _backward_mm(x, w, dy.contiguous(), ctx.counts, ctx.n_threads, need)
        return dx, dw, None, None


@torch.compiler.disable  # threads and host counts: compiled code calls it eagerly
def threaded_grouped_mm(
    x: Tensor, w: Tensor, counts: Sequence[int], n_threads: int | None = None
) -> Tensor:
    """x (M, K) sorted by group, w (G, K, N), counts (G,) host ints -> (M, N), the groups'
    GEMMs spread over `n_threads` (default: torch's intra-op threads), differentiable."""
    if len(counts) != w.shape[0] or sum(counts) != x.shape[0]:
        raise ValueError(
            f"{len(counts)} group counts summing to {sum(counts)} for {w.shape[0]} "
            f"groups and {x.shape[0]} rows"
        )
    threads = n_threads or torch.get_num_threads()
    return _ThreadedGroupedMM.apply(x.contiguous(), w.contiguous(), tuple(counts), threads)
