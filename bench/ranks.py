"""Run a benchmark function on N gloo ranks (spawned processes) and return rank 0's result.

`fn(rank, world, *args)` must be importable (a module-level function). Each rank gets
`cores // world` torch threads, so one process and N ranks share the same cores.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_on_ranks(world: int, cores: int, fn: Callable[..., Any], *args: Any) -> Any:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.pkl")
        spawn_args = (world, port, out, cores, fn, args)
        mp.start_processes(_entry, spawn_args, nprocs=world, start_method="spawn")
        return pickle.loads(Path(out).read_bytes())


def _entry(
    rank: int, world: int, port: int, out: str, cores: int, fn: Callable, args: tuple
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, cores // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = fn(rank, world, *args)
    dist.barrier()  # no rank tears gloo down while a peer is still talking to it
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_bytes(pickle.dumps(result))


def add_step_arguments(parser) -> None:
    """The step-timing options the multi-rank benchmarks share."""
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6, help="timed steps (median counts)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
