"""A grouped GEMM for CPU that runs its groups in parallel, one intra-op thread each.

torch's CPU `_grouped_mm` (and a loop of `mm`) computes one group after another, each GEMM split
over all intra-op threads. A fine-grained expert's group is small (E=256 top-8 over 4096 tokens:
about 128 rows of C=512 by F=256) and splits badly: on a 2-core AVX2 CPU such a fp32 GEMM runs
1.3x faster on 2 threads than on 1, where a batched GEMM over the same (balanced) groups, which
gives each thread whole groups, runs 1.9x faster. Here the groups are cut into one contiguous
range per thread, with about equal rows in each, and every range runs on a pool thread whose
GEMMs are single-threaded, while the caller waits. Each pool thread sets its own intra-op count
to 1 once, when the pool starts (OpenMP's and MKL's counts are per thread; torch also keeps the
last count set as the one new threads start with, which the caller restores right after): the
caller's own thread count is never touched. Every GEMM is computed whole on one thread, so the
result does not depend on the thread count (it can differ in the last bits from a
multi-threaded GEMM's). Under a TorchDispatchMode (FLOP counters, GEMM timers), which sees only
its own thread's ops, the ranges run on the calling thread instead. torch.profiler records no op
run on the pool's threads: a profile shows the ranges as one span, `lmforge::threaded_ranges`,
on the calling thread.

Shapes: x (M, K) rows grouped in order, w (G, K, N), counts G ints summing to M -> (M, N).
Backward: dx[g] = dy[g] w[g]^T, dw[g] = x[g]^T dy[g], threaded the same way.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

_POOL: dict[str, ThreadPoolExecutor | int] = {}  # "pool", "workers": one pool, grown on demand
_USERS: dict[ThreadPoolExecutor, int] = {}  # callers running ranges on each pool now
_POOL_LOCK = threading.Lock()


@contextmanager
def _borrowed_pool(workers: int) -> Iterator[ThreadPoolExecutor]:
    """The pool, with at least `workers` threads, all started and single-threaded. A pool
    replaced by a larger one is shut down (its threads exit) once no caller still uses it."""
    with _POOL_LOCK:
        if _POOL.get("workers", 0) < workers:
            retired = _POOL.get("pool")
            _POOL.update(pool=_start_pool(workers), workers=workers)
            if retired is not None and not _USERS.get(retired):
                retired.shutdown(wait=False)
        pool = _POOL["pool"]
        _USERS[pool] = _USERS.get(pool, 0) + 1
    try:
        yield pool
    finally:
        with _POOL_LOCK:
            _USERS[pool] -= 1
            if not _USERS[pool]:
                del _USERS[pool]
                if pool is not _POOL.get("pool"):
                    pool.shutdown(wait=False)


def _start_pool(workers: int) -> ThreadPoolExecutor:
    caller_threads = torch.get_num_threads()
    barrier = threading.Barrier(workers, timeout=60)
    pool = ThreadPoolExecutor(workers, thread_name_prefix="lmforge-grouped-mm")
    try:  # every worker starts now (each task holds its thread until all have one), count 1
        for future in [pool.submit(_start_worker, barrier) for _ in range(workers)]:
            future.result()
    except BaseException:
        barrier.abort()
        pool.shutdown(wait=False)
        raise
    finally:
        torch.set_num_threads(caller_threads)  # the count new threads start with, as it was
    return pool


def _start_worker(barrier: threading.Barrier) -> None:
    # torch initializes a thread's count lazily, from the last count set anywhere, at its first
    # get_num_threads or parallel op: that first, so the 1 set here is not overwritten later
    torch.get_num_threads()
    torch.set_num_threads(1)
    barrier.wait()


def _forget_pool() -> None:
    """In a forked child (torchrun's workers, the tests' rank server), which has none of the
    parent's threads and may have copied the lock held."""
    global _POOL_LOCK
    _POOL.clear()
    _USERS.clear()
    _POOL_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def thread_ranges(counts: Sequence[int], n_threads: int) -> list[tuple[int, int]]:
    """Contiguous group ranges [lo, hi), at most `n_threads`, each holding about M / n_threads
    rows: range t ends at the group boundary nearest to t shares of the rows (a group larger
    than a share, a hot expert, gets a range of its own rather than swallowing the rest)."""
    total = sum(counts)
    ranges, lo, done = [], 0, 0
    for t in range(1, n_threads):
        target, hi = total * t / n_threads, lo
        while hi < len(counts) and done + counts[hi] - target <= target - done:
            done += counts[hi]
            hi += 1
        if hi > lo:
            ranges.append((lo, hi))
            lo = hi
    if lo < len(counts):
        ranges.append((lo, len(counts)))
    return ranges


def _run_range(work: Callable[[int, int], None], lo: int, hi: int, inference: bool) -> None:
    """work(lo, hi) with no autograd recording and no autocast, in the caller's inference mode
    (grad, autocast and inference modes are per thread: a pool thread's are the defaults, and
    out= into an inference tensor needs inference mode)."""
    with (
        torch.inference_mode(inference),
        torch.no_grad(),
        torch.autocast("cpu", enabled=False),
    ):
        work(lo, hi)


def run_in_parallel(work: Callable[[int, int], None], ranges: list[tuple[int, int]]) -> None:
    """work(lo, hi) for every range, each on its own single-threaded pool thread (one range
    too, so that every GEMM is computed alike whatever the thread count); the caller waits for
    all of them, even when one raised or the caller is interrupted (they write into the caller's
    buffers), then raises the first error. Under a TorchDispatchMode the ranges run here, one
    after another."""
    if not ranges:
        return
    inference = torch.is_inference_mode_enabled()
    if _get_current_dispatch_mode_stack():
        for lo, hi in ranges:
            _run_range(work, lo, hi, inference)
        return
    with (
        torch.profiler.record_function("lmforge::threaded_ranges"),  # the pool's ops go unseen
        _borrowed_pool(len(ranges)) as pool,
    ):
        futures = []
        try:  # (submitting too: a Ctrl-C that lands before the last submit returns)
            for lo, hi in ranges:
                futures.append(pool.submit(_run_range, work, lo, hi, inference))
            errors = [f.exception() for f in futures]
        except BaseException:  # Ctrl-C while waiting: stop what has not begun, let the running
            for future in futures:  # ranges end (they write into the caller's buffers), raise
                future.cancel()
            wait(futures)
            raise
    for error in errors:
        if error is not None:
            raise error


def row_starts(counts: Sequence[int]) -> list[int]:
    """The first row of each group, then the total: G + 1 ints."""
    return list(itertools.accumulate(counts, initial=0))


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


def check_groups(x: Tensor, w: Tensor, counts: Sequence[int]) -> None:
    """One-line errors for what would make threads write over each other or off the CPU."""
    if x.device.type != "cpu" or w.device.type != "cpu":
        raise ValueError(f"the threaded grouped GEMM runs on CPU, got {x.device} and {w.device}")
    if len(counts) != w.shape[0] or sum(counts) != x.shape[0] or min(counts, default=0) < 0:
        raise ValueError(
            f"{len(counts)} group counts summing to {sum(counts)} (smallest "
            f"{min(counts, default=0)}) for {w.shape[0]} groups and {x.shape[0]} rows"
        )


@torch.compiler.disable  # threads and host counts: compiled code calls it eagerly
def threaded_grouped_mm(
    x: Tensor, w: Tensor, counts: Sequence[int], n_threads: int | None = None
) -> Tensor:
    """x (M, K) sorted by group, w (G, K, N), counts (G,) host ints -> (M, N), the groups'
    GEMMs spread over `n_threads` (default: torch's intra-op threads), differentiable."""
    check_groups(x, w, counts)
    threads = n_threads or torch.get_num_threads()
    return _ThreadedGroupedMM.apply(x.contiguous(), w.contiguous(), tuple(counts), threads)
