"""DCP checkpoints that appear only when complete, and resume from the newest good one.

    checkpoints/step_00000100/   .metadata + *.distcp (model and optimizer, via DCP)
                                 trainer_rank<R>.pt (step, loader, RNG states, wandb id, config)
    checkpoints/latest           the name of the newest complete checkpoint

A checkpoint is written to `step_<N>.tmp/`, renamed to `step_<N>/` when every rank has written
its part, and only then named in `latest`; the oldest beyond `keep` are deleted. Model and
optimizer states come from `torch.distributed.checkpoint.state_dict`, which gives parameter-name
keyed states for plain and FSDP2 models alike, so DCP can reshard them on load.
"""

from __future__ import annotations

import logging
import shutil
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from data.atomic import atomic_write_bytes

log = logging.getLogger("trainer.checkpoint")
LATEST = "latest"
# what a damaged checkpoint raises: DCP's CheckpointException derives from BaseException
LOAD_ERRORS = (Exception, CheckpointException)
# DCP warns that it assumes a single process when no process group exists: that is meant here
# (also from the thread of an asynchronous save, so a filter rather than a catch_warnings block)
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*single process")
PREFIX = "step_"


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was asked for."""


@dataclass
class Restored:
    path: Path
    extra: dict[str, Any]  # step, loader state, rng, wandb id, ...


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def step_dir(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:08d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """Finished checkpoints, newest first (temporaries are never listed)."""
    if not root.is_dir():
        return []
    found = [
        p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.suffix == ""
    ]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX) :]), reverse=True)


class Checkpointer:
    """Writes checkpoints under `root`; with `async_save`, DCP snapshots the state and writes
    it in the background while training goes on, and the checkpoint is committed (renamed,
    named in `latest`) once the write has finished: polled at step boundaries, and awaited
    before the next save and at the end."""

    def __init__(self, root: Path, rank: int, keep: int, async_save: bool = False):
        self.root, self.rank, self.keep, self.async_save = root, rank, keep, async_save
        self._pending: tuple[Future, Path, Path] | None = None

    def save(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any]
    ) -> Path:
        self.wait()
        final = step_dir(self.root, step)
        tmp = final.with_name(final.name + ".tmp")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        tmp.mkdir(parents=True, exist_ok=True)  # other nodes may not see rank 0's mkdir yet
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        torch.save(extra, tmp / f"trainer_rank{self.rank}.pt")
        if self.async_save:
            self._pending = (dcp.async_save(state, checkpoint_id=str(tmp)), tmp, final)
            return final
        dcp.save(state, checkpoint_id=str(tmp))
        self._commit(tmp, final)
        return final

    def poll(self) -> Path | None:
        """Commit a finished background write (one process only: ranks would have to agree)."""
        if self._pending is None or not self._pending[0].done():
            return None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return None
        return self.wait()

    def wait(self) -> Path | None:
        """Finish and commit the background write, if there is one."""
        if self._pending is None:
            return None
        future, tmp, final = self._pending
        self._pending = None
        future.result()
        self._commit(tmp, final)
        return final

    def _commit(self, tmp: Path, final: Path) -> None:
        _barrier()
        if self.rank == 0:
            if final.exists():  # a re-save of the same step (after a resume): replace it
                shutil.rmtree(final)
            tmp.rename(final)
            atomic_write_bytes(self.root / LATEST, (final.name + "\n").encode())
            for old in complete_checkpoints(self.root)[self.keep :]:
                shutil.rmtree(old, ignore_errors=True)
        _barrier()


def load_checkpoint(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int
) -> dict[str, Any]:
    """Load model and optimizer in place (DCP reshards them to this run's layout); returns the
    extra state saved by this rank, or by rank 0 when the checkpoint came from fewer ranks
    (the loader position is global, so it holds for any number of ranks).

    Every rank takes the same decision: the small per-rank file is read first and its success
    agreed on before DCP's collective load, whose errors reach every rank."""
    extra: dict[str, Any] | None = None
    problem = ""
    try:
        extra = _read_extra(path, rank)
    except LOAD_ERRORS as err:
        problem = _brief(err)
    if not _all_ranks_ok(not problem):
        raise CheckpointError(f"{path} is incomplete or damaged ({problem or 'on another rank'})")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    assert extra is not None
    return extra


def _read_extra(path: Path, rank: int) -> dict[str, Any]:
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{path} is incomplete (no .metadata)")
    extra_path = path / f"trainer_rank{rank}.pt"
    if not extra_path.is_file():
        extra_path = path / "trainer_rank0.pt"
        if not extra_path.is_file():
            raise CheckpointError(f"{path} is incomplete (no trainer_rank0.pt)")
    return torch.load(extra_path, weights_only=False)


def _all_ranks_ok(ok: bool) -> bool:
    """True when `ok` holds on every rank (one small all-reduce; itself with one process)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return ok
    flag = torch.tensor([int(ok)], dtype=torch.int32)
    if "gloo" not in str(dist.get_backend()):
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _agreed_candidates(root: Path) -> list[Path]:
    """Rank 0's list of complete checkpoints, on every rank (listings of a shared file system
    may differ between nodes for a moment)."""
    found = [str(p) for p in complete_checkpoints(root)]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [found]
        dist.broadcast_object_list(box, src=0)
        found = box[0]
    return [Path(p) for p in found]


def resume(
    resume_from: str,
    root: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
) -> Restored | None:
    """`auto`: newest complete checkpoint under `root` (falling back past damaged ones, all
    ranks together); `none`: start fresh; anything else: that checkpoint directory, which must
    load."""
    if resume_from == "none":
        return None
    if resume_from != "auto":
        path = Path(resume_from).expanduser()
        try:
            return Restored(path, load_checkpoint(path, model, optimizer, rank))
        except LOAD_ERRORS as err:
            raise CheckpointError(f"resume={resume_from} cannot be loaded: {_brief(err)}") from err
    for path in _agreed_candidates(root):
        try:
            extra = load_checkpoint(path, model, optimizer, rank)
        except LOAD_ERRORS as err:
            log.warning(
                "checkpoint %s is damaged (%s); trying the one before it", path, _brief(err)
            )
            continue
        return Restored(path, extra)
    return None


def _brief(err: BaseException) -> str:
    """One line: DCP's exceptions carry every rank's whole traceback in their text."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[-1] if lines else ''}"
