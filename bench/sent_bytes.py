"""The bytes a rank sends in functional collectives, counted as they run (context parallelism's
all-gathers of keys/values, states and halos, and their gradients' reduce-scatters): what
bench/context_parallel_memory.py records and tests/parallel/test_context_parallel.py checks
against the planner (model/planner_context.py)."""

from __future__ import annotations

import torch


class SentBytes:
    """Counts the bytes this rank sends in functional all-gathers and reduce-scatters: (P - 1) /
    P of the gathered (or scattered) whole, a ring's."""

    def __init__(self, world: int) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        ops = torch.ops._c10d_functional
        gather, scatter = ops.all_gather_into_tensor.default, ops.reduce_scatter_tensor.default
        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                whole = out if func is gather else args[0] if func is scatter else None
                if whole is not None:
                    counter.sent += (world - 1) / world * whole.numel() * whole.element_size()
                return out

        self.sent, self.mode = 0.0, Mode()
