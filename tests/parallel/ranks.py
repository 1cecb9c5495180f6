"""Run a function on N gloo ranks (processes on this CPU) and collect what each returns.

The function must live in an importable module and take the rank first. The ranks are forked
from torch.multiprocessing's forkserver, a process that has imported torch, DeepSpeed and the
test workers once (tests/parallel/preload.py; imports only: no thread pool, no process
group), so a test's ranks start in a fraction of a second instead of the seconds a fresh
interpreter takes. Each rank takes the test process's environment as it is at the call, as a
spawned one would, and writes its output to a file that the test prints (pytest shows it with a
failure): a forked rank's own stdout would be the server's.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.distributed import destroy_process_group

if not torch.cuda.is_available():  # DeepSpeed picks its accelerator when imported
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
mp.set_forkserver_preload(["tests.parallel.preload"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """fn(rank, *args) on `world_size` ranks; returns the results by rank."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.start_processes(
                _entry,
                args=(world_size, port, tmp, dict(os.environ), fn, args),
                nprocs=world_size,
                join=True,
                start_method="forkserver",
            )
        finally:
            for r in range(world_size):
                log = Path(tmp, f"{r}.log")
                if log.is_file() and log.stat().st_size:
                    print(f"--- rank {r} ---\n{log.read_text()}", file=sys.stderr)
        return [pickle.loads(Path(tmp, f"{r}.pkl").read_bytes()) for r in range(world_size)]


def _entry(
    rank: int, world_size: int, port: int, tmp: str, environ: dict, fn: Callable, args: tuple
) -> None:
    log = os.open(Path(tmp, f"{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
        os.dup2(log, stream.fileno())
    os.environ.clear()
    os.environ.update(environ)
    env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world_size, "MASTER_PORT": port}
    os.environ.update({k: str(v) for k, v in env.items()} | {"MASTER_ADDR": "127.0.0.1"})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, *args)
        dist.barrier()
    finally:
        destroy_process_group()
    Path(tmp, f"{rank}.pkl").write_bytes(pickle.dumps(result))
