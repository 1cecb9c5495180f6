"""Graceful stop: SIGTERM, SIGUSR2 and SIGINT (Ctrl-C) only set a flag; the loop checks it at step
boundaries (and inside evaluation), saves a checkpoint and exits cleanly. A second Ctrl-C exits
at once, without saving.

With several ranks, a signal may reach only some of them, so the decision is all-reduced (MAX
of the signal numbers) at each check: every rank stops at the same step, knowing the signal.

Under torchrun, a worker whose agent dies (killed with -9, its node's session ended) would train
on forever: `ParentWatch` notices the new parent process and requests a stop like SIGTERM; if
the save cannot finish (a collective with a rank that is gone), the worker exits after
`grace_s` anyway.
"""

from __future__ import annotations

import os
import signal
import threading
import time

from parallel.collective import max_over_ranks

HANDLED = (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT)
ORPHANED = signal.SIGTERM  # what a dead launcher counts as


class StopFlag:
    def __init__(self) -> None:
        self.received: int | None = None  # written only by the handler, on this rank
        self.agreed: int | None = None  # the largest signal number any rank received

    def install(self) -> None:
        for sig in HANDLED:
            signal.signal(sig, self._handler)

    def _handler(self, signum: int, frame: object) -> None:
        if signum == signal.SIGINT:
            if self.received == signal.SIGINT:  # the second Ctrl-C: leave now
                os.write(2, b"\nsecond Ctrl-C: exiting now, without a checkpoint\n")
                os._exit(130)
            os.write(2, b"\nCtrl-C: saving a checkpoint after this step (Ctrl-C again: quit)\n")
        self.received = signum  # nothing else: the loop acts on it at a safe point

    def requested(self) -> bool:
        """True on every rank when any rank received a stop signal."""
        local = self.received or 0  # read once: the handler may run at any bytecode
        # the signal number itself (0: none), so every rank also agrees on which one
        local = max_over_ranks(local)
        self.agreed = max(self.agreed or 0, local) or None
        return self.agreed is not None

    def requeue_wanted(self) -> bool:
        """SIGUSR2 is the pre-timeout signal of the sbatch templates: the job should come back.
        SIGTERM (scancel, or preemption, which SLURM requeues itself when so configured) not."""
        return self.agreed == signal.SIGUSR2

    def exit_code(self) -> int:
        """130 after Ctrl-C (as shells expect), 0 after the cluster's stop signals."""
        return 130 if self.agreed == signal.SIGINT else 0

    def name(self) -> str:
        return signal.Signals(self.agreed).name if self.agreed else "a stop request"


class ParentWatch:
    """A daemon thread: when this process's parent changes (the launcher died and the process
    was re-parented), request a stop; `grace_s` later, exit whatever the loop is doing."""

    def __init__(self, stop: StopFlag, grace_s: float, poll_s: float = 1.0):
        self.stop, self.grace_s, self.poll_s = stop, grace_s, poll_s
        self.parent = os.getppid()

    def start(self) -> None:
        threading.Thread(target=self._watch, name="parent-watch", daemon=True).start()

    def _watch(self) -> None:
        while os.getppid() == self.parent:
            time.sleep(self.poll_s)
        os.write(2, f"the launcher (pid {self.parent}) is gone: saving and exiting\n".encode())
        if self.stop.received is None:
            self.stop.received = ORPHANED
        time.sleep(self.grace_s)
        os.write(
            2, f"still running {self.grace_s:.0f} s after the launcher died: exiting\n".encode()
        )
        os._exit(1)


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ
