"""Graceful stop: SIGTERM / SIGUSR2 only set a flag; the loop checks it at step boundaries
(and inside evaluation), saves a checkpoint and exits cleanly.

With several ranks, a signal may reach only some of them, so the decision is all-reduced (MAX
of the signal numbers) at each check: every rank stops at the same step, knowing the signal.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

HANDLED = (signal.SIGTERM, signal.SIGUSR2)


class StopFlag:
    def __init__(self) -> None:
        self.received: int | None = None  # written only by the handler, on this rank
        self.agreed: int | None = None  # the largest signal number any rank received

    def install(self) -> None:
        for sig in HANDLED:
            signal.signal(sig, self._handler)

    def _handler(self, signum: int, frame: object) -> None:
        self.received = signum  # nothing else: the loop acts on it at a safe point

    def requested(self) -> bool:
        """True on every rank when any rank received a stop signal."""
        local = self.received or 0  # read once: the handler may run at any bytecode
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # the signal number itself (0: none), so every rank also agrees on which one
            flag = torch.tensor([local], dtype=torch.int32)
            if "gloo" not in str(dist.get_backend()):  # NCCL alone: the flag goes via the GPU
                flag = flag.cuda()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            local = int(flag.item())
        self.agreed = max(self.agreed or 0, local) or None
        return self.agreed is not None

    def requeue_wanted(self) -> bool:
        """SIGUSR2 is the pre-timeout signal of the sbatch templates: the job should come back.
        SIGTERM (scancel, or preemption, which SLURM requeues itself when so configured) not."""
        return self.agreed == signal.SIGUSR2

    def name(self) -> str:
        return signal.Signals(self.agreed).name if self.agreed else "a stop request"
