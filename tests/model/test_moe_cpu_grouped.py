"""The threaded CPU grouped GEMM: its thread ranges, bitwise equality with the serial per-group
loop for any thread count (each GEMM runs whole on one thread), gradients against float64,
empty groups, errors raised in a pool thread, the caller's thread count and grad mode left as
they were, and a forked child that can still use it."""

from __future__ import annotations

import itertools
import multiprocessing
import signal
import threading
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model.moe import cpu_grouped
from model.moe.cpu_grouped import run_in_parallel, thread_ranges, threaded_grouped_mm

COUNTS = [5, 0, 3, 0, 9, 1, 0, 6, 0]  # empty groups at the start of a range, inside, and last


def serial(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The per-group loop on one thread (a GEMM split over threads may round differently)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return torch.cat([chunk @ w_g for chunk, w_g in zip(torch.split(x, counts), w.unbind(0))])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("n_threads", [1, 2, 3, 4, 16])
def test_ranges_cover_every_group_once_in_order_with_about_equal_rows(n_threads):
    counts = [7, 0, 130, 128, 1, 0, 90, 200, 64, 64, 3, 0]
    ranges = thread_ranges(counts, n_threads)
    assert ranges[0][0] == 0 and ranges[-1][1] == len(counts)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))  # contiguous, none empty
    assert all(lo < hi for lo, hi in ranges) and len(ranges) <= n_threads
    share = sum(counts) / n_threads
    rows = [sum(counts[lo:hi]) for lo, hi in ranges]
    assert max(rows) <= share + max(counts)  # a range overshoots by less than one group


def test_a_hot_expert_gets_a_range_of_its_own():
    assert thread_ranges([300] + [10] * 10, 2) == [(0, 1), (1, 11)]
    assert thread_ranges([10] * 10 + [300], 2) == [(0, 10), (10, 11)]


def test_ranges_of_no_rows_and_of_more_threads_than_groups():
    assert thread_ranges([0, 0, 0], 2) == [(0, 3)]
    assert thread_ranges([4, 4], 8) == [(0, 1), (1, 2)]
    assert thread_ranges([], 2) == []


@pytest.mark.parametrize("n_threads", [1, 2, 3, 5])
def test_forward_and_gradients_equal_the_serial_loop_bitwise(n_threads):
    torch.manual_seed(0)
    x = torch.randn(sum(COUNTS), 24, requires_grad=True)
    w = torch.randn(len(COUNTS), 24, 20, requires_grad=True)
    g = torch.randn(sum(COUNTS), 20)
    y = threaded_grouped_mm(x, w, COUNTS, n_threads)
    gx, gw = torch.autograd.grad(y, (x, w), g)
    want = serial(x, w, COUNTS)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the loop's backward GEMMs on one thread too
    try:
        want_gx, want_gw = torch.autograd.grad(want, (x, w), g)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(y, want)
    assert torch.equal(gx, want_gx)
    assert torch.equal(gw, want_gw)
    for e, n in enumerate(COUNTS):
        if n == 0:
            assert gw[e].abs().sum() == 0  # an empty group gets a zero gradient


def test_gradients_match_float64_with_an_expanded_upstream_gradient():
    torch.manual_seed(1)
    x = torch.randn(sum(COUNTS), 16, requires_grad=True)
    w = torch.randn(len(COUNTS), 16, 12, requires_grad=True)
    threaded_grouped_mm(x, w, COUNTS, 2).sum().backward()  # strides-0 gradient
    xd, wd = (t.detach().double().requires_grad_() for t in (x, w))
    serial(xd, wd, COUNTS).sum().backward()
    torch.testing.assert_close(x.grad.double(), xd.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(w.grad.double(), wd.grad, atol=1e-5, rtol=1e-4)


def test_bf16_and_weights_that_need_no_gradient():
    torch.manual_seed(2)
    x = torch.randn(sum(COUNTS), 16, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(len(COUNTS), 16, 8, dtype=torch.bfloat16)
    y = threaded_grouped_mm(x, w, COUNTS, 2)
    assert y.dtype == torch.bfloat16 and torch.equal(y, serial(x, w, COUNTS))
    y.sum().backward()
    assert x.grad is not None and w.grad is None


def test_the_callers_thread_count_and_grad_mode_are_left_alone():
    before = torch.get_num_threads()
    x = torch.randn(sum(COUNTS), 8, requires_grad=True)
    y = threaded_grouped_mm(x, torch.randn(len(COUNTS), 8, 4), COUNTS, 3)
    y.sum().backward()
    assert torch.get_num_threads() == before and torch.is_grad_enabled()


def test_bad_counts_are_refused_in_one_line():
    x, w = torch.randn(10, 4), torch.randn(3, 4, 4)
    with pytest.raises(
        ValueError, match=r"3 group counts summing to 9 \(smallest 3\) for 3 groups and 10 rows"
    ):
        threaded_grouped_mm(x, w, [3, 3, 3])
    with pytest.raises(ValueError, match="2 group counts"):
        threaded_grouped_mm(x, w, [5, 5])
    with pytest.raises(ValueError, match="smallest -2"):  # ranges would overlap
        threaded_grouped_mm(x, w, [5, -2, 7])
    with pytest.raises(ValueError, match="runs on CPU, got meta"):
        threaded_grouped_mm(x.to("meta"), w.to("meta"), [3, 3, 4])


def test_an_error_in_a_pool_thread_reaches_the_caller_after_every_range_ended():
    done = []

    def work(lo: int, hi: int) -> None:
        if lo == 3:
            time.sleep(0.3)  # still writing when range 2 fails
        done.append(lo)
        if lo == 2:
            raise RuntimeError(f"range {lo}")

    with pytest.raises(RuntimeError, match="range 2"):
        run_in_parallel(work, [(0, 2), (2, 3), (3, 4)])
    assert sorted(done) == [0, 2, 3]


def test_an_interrupted_caller_raises_only_after_the_running_ranges_ended():
    done, main, both_running = [], threading.main_thread().ident, threading.Barrier(2, timeout=10)

    def work(lo: int, hi: int) -> None:
        both_running.wait()
        if lo == 0:
            signal.pthread_kill(main, signal.SIGINT)  # Ctrl-C while the caller waits
        time.sleep(0.3)  # both still writing into the caller's buffers
        done.append(lo)

    # Python's own Ctrl-C handler, whatever an earlier test in this process installed (in a
    # full run this test once saw no KeyboardInterrupt: a handler that does not raise)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_in_parallel(work, [(0, 1), (1, 2)])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert sorted(done) == [0, 1]  # nothing left running once the caller has the interrupt


def _child_result(queue) -> None:
    x = torch.randn(sum(COUNTS), 8)
    w = torch.randn(len(COUNTS), 8, 4)
    queue.put(bool(torch.equal(threaded_grouped_mm(x, w, COUNTS, 2), serial(x, w, COUNTS))))


def test_a_forked_child_gets_its_own_pool():
    threaded_grouped_mm(
        torch.randn(sum(COUNTS), 8), torch.randn(len(COUNTS), 8, 4), COUNTS, 2
    )  # the parent's pool
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_result, args=(queue,))
    child.start()
    try:
        child.join(timeout=60)
        assert child.exitcode == 0, "the forked child hung or died using the grouped GEMM"
    finally:
        child.kill()
    assert queue.get(timeout=5) is True


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad", "autocast"])
def test_it_runs_under_the_callers_inference_grad_and_autocast_modes(mode):
    x = torch.randn(sum(COUNTS), 8)
    w = torch.randn(len(COUNTS), 8, 4)
    context = {
        "inference_mode": torch.inference_mode,
        "no_grad": torch.no_grad,
        "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    }[mode]
    with context():
        y = threaded_grouped_mm(x, w, COUNTS, 3)
    assert y.dtype == torch.float32  # the caller's tensors' dtype, autocast or not
    torch.testing.assert_close(y, serial(x, w, COUNTS), atol=1e-5, rtol=1e-4)


def test_no_groups_give_no_rows():
    y = threaded_grouped_mm(torch.randn(0, 4), torch.randn(0, 4, 3), [], 2)
    assert y.shape == (0, 3)


@pytest.fixture
def own_pool(monkeypatch):
    """Pools started by the test (not the module's), shut down after it."""
    monkeypatch.setattr(cpu_grouped, "_POOL", {})
    monkeypatch.setattr(cpu_grouped, "_USERS", {})
    yield
    if "pool" in cpu_grouped._POOL:
        cpu_grouped._POOL["pool"].shutdown(wait=False)


def test_threads_started_afterwards_get_the_callers_thread_count(own_pool):
    threaded_grouped_mm(torch.randn(sum(COUNTS), 8), torch.randn(len(COUNTS), 8, 4), COUNTS, 3)
    seen = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert seen == [torch.get_num_threads()]


def test_a_dispatch_mode_on_the_calling_thread_sees_every_gemm():
    calls = []

    class CountMM(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten.mm:
                calls.append(args[0].shape[0])
            return func(*args, **(kwargs or {}))

    x, w = torch.randn(sum(COUNTS), 8), torch.randn(len(COUNTS), 8, 4)
    with CountMM():
        y = threaded_grouped_mm(x, w, COUNTS, 3)
    assert sorted(calls) == sorted(COUNTS)  # one GEMM per group, empty ones included
    torch.testing.assert_close(y, serial(x, w, COUNTS), atol=1e-5, rtol=1e-4)


def test_every_pool_thread_runs_single_threaded_while_the_caller_keeps_its_count(own_pool):
    before = torch.get_num_threads()
    seen = []

    def work(lo: int, hi: int) -> None:
        seen.append(torch.get_num_threads())

    run_in_parallel(work, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)])  # grows the pool to 5
    assert seen == [1] * 5 and torch.get_num_threads() == before


def _shut_down(pool) -> bool:
    try:
        pool.submit(lambda: None)  # queued, not waited for: the pool's threads may be busy
    except RuntimeError:  # "cannot schedule new futures after shutdown"
        return True
    return False


def test_a_pool_outgrown_is_shut_down_once_no_caller_uses_it(own_pool):
    release, started = threading.Event(), threading.Barrier(3, timeout=30)

    def held(lo: int, hi: int) -> None:
        started.wait()
        assert release.wait(30)

    errors = []

    def call() -> None:
        try:
            run_in_parallel(held, [(0, 1), (1, 2)])
        except BaseException as error:
            errors.append(error)

    caller = threading.Thread(target=call)
    caller.start()
    started.wait()  # both ranges run on the two-thread pool
    small = cpu_grouped._POOL["pool"]
    run_in_parallel(lambda lo, hi: None, [(0, 1), (1, 2), (2, 3)])  # grows the pool to 3
    assert cpu_grouped._POOL["pool"] is not small
    assert not _shut_down(small)  # still running the other caller's ranges
    release.set()
    caller.join(30)
    assert not errors and not caller.is_alive()
    assert _shut_down(small) and not cpu_grouped._USERS  # shut down when its last user left
    run_in_parallel(lambda lo, hi: None, [(0, 1)])
    assert not _shut_down(cpu_grouped._POOL["pool"])


def test_the_ranges_show_in_a_profile_as_one_named_span():
    x, w = torch.randn(sum(COUNTS), 8), torch.randn(len(COUNTS), 8, 4)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        threaded_grouped_mm(x, w, COUNTS, 2)
    names = [event.name for event in prof.events()]
    assert names.count("lmforge::threaded_ranges") == 1
