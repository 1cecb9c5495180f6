"""The process group of a multi-rank launch (torchrun / srun), and the run directory all ranks
share.

`torchrun` and `srun` set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; with more
than one rank the group is created here (NCCL on GPUs, gloo on CPU), before logging starts, so
that rank 0 can tell the others which run directory this launch writes to.
"""

from __future__ import annotations

import gc
import os
import shutil
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from model.errors import ConfigError
from trainer.checkpoint.errors import CheckpointError
from trainer.runtime import Ranks

REQUIRED_ENV = ("MASTER_ADDR", "MASTER_PORT")


def init_distributed(
    ranks: Ranks, backend: str, device: torch.device, timeout_s: float = 300.0
) -> None:
    """Create the default process group when WORLD_SIZE > 1 (no-op for one process); a
    collective that waits longer than `timeout_s` for the other ranks raises."""
    if ranks.world_size == 1 or dist.is_initialized():
        return
    missing = [key for key in REQUIRED_ENV if not os.environ.get(key)]
    if missing:
        raise ConfigError(
            f"WORLD_SIZE={ranks.world_size} but {', '.join(missing)} is not set: launch with "
            "torchrun (or srun with the launch/ scripts), which sets the rendezvous variables"
        )
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError("parallel.backend=nccl needs CUDA devices; use gloo on CPU")
    if backend == "nccl":  # plus gloo for CPU tensors: asynchronous DCP saves need it
        backend = "cpu:gloo,cuda:nccl"
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend,
        store=_attempt_store(ranks, timeout),
        rank=ranks.rank,
        world_size=ranks.world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )


def _attempt_store(ranks: Ranks, timeout: timedelta) -> dist.Store:
    """The env:// store, with a key prefix per torchrun restart. After an elastic restart the
    workers meet in torchrun's store again, which still holds the dead workers' gloo addresses
    under the same keys: a fast rank can read a stale one and wait for a process that is gone.
    The prefix gives every attempt its own keys."""
    store, _, _ = next(dist.rendezvous("env://", ranks.rank, ranks.world_size, timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"lmforge/attempt_{attempt}/", store)


def agree_on_run_dir(run_dir: Path, ranks: Ranks) -> Path:
    """Rank 0's run directory, on every rank. Normally all ranks computed the same one (from the
    SLURM job id or torchrun's run id); if not, the others drop their stray empty directory."""
    if ranks.world_size == 1:
        return run_dir
    chosen = [str(run_dir)]
    dist.broadcast_object_list(chosen, src=0)
    agreed = Path(chosen[0])
    if agreed.resolve() != run_dir.resolve() and run_dir.is_dir() and not any(run_dir.iterdir()):
        shutil.rmtree(run_dir, ignore_errors=True)
    return agreed


TIMEOUT_MARKS = ("timed out waiting", "operation timeout", "timed out after", "wait timeout")


def is_collective_timeout(err: BaseException) -> bool:
    """gloo's "Timed out waiting ... for recv" and NCCL's watchdog timeouts (not our own
    errors, whose messages may name a path that happens to say "timeout")."""
    if not isinstance(err, RuntimeError) or isinstance(err, CheckpointError | ConfigError):
        return False
    text = str(err).lower()
    return any(mark in text for mark in TIMEOUT_MARKS)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.barrier()
        destroy_process_group()


def destroy_process_group() -> None:
    """Destroy the default group and free it now. Left to interpreter exit, gloo's worker thread
    may still be releasing the last collective's tensors (which needs the GIL) while Python
    finalizes: the thread is torn down inside a C++ destructor and the process aborts (SIGABRT,
    exit 134, in about one exit in seven on this machine). Collecting the cycles that hold the
    group (FSDP states, device meshes) joins that thread first."""
    dist.destroy_process_group()
    gc.collect()
