"""Graceful stop: SIGTERM / SIGUSR2 only set a flag; the loop checks it at step boundaries
(and inside evaluation), saves a checkpoint and exits cleanly.

With several ranks, a signal may reach only some of them, so the decision is all-reduced (MAX)
at each check: every rank stops at the same step.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

HANDLED = (signal.SIGTERM, signal.SIGUSR2)


class StopFlag:
    def __init__(self) -> None:
        self.signum: int | None = None

    def install(self) -> None:
        for sig in HANDLED:
            signal.signal(sig, self._handler)

    def _handler(self, signum: int, frame: object) -> None:
        self.signum = signum  # nothing else: the loop acts on it at a safe point

    def requested(self) -> bool:
        """True on every rank when any rank received a stop signal."""
        local = self.signum is not None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([int(local)], dtype=torch.int32)
            if "gloo" not in str(dist.get_backend()):  # NCCL alone: the flag goes via the GPU
                flag = flag.cuda()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            return bool(flag.item())
        return local

    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else "a stop request"
