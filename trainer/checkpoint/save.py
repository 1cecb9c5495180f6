"""The checkpoint transaction: a checkpoint appears only when complete and verified.

    checkpoints/step_00000100/   the engine's files (parallel.checkpoint_format: DCP's
                                 .metadata + *.distcp, or DeepSpeed's deepspeed/ folder)
                                 trainer_rank<R>.pt (step, loader, RNG states, run id, configs)
                                 commit.json (run id, write order, checksum of every file)
    checkpoints/latest           the name of the newest complete checkpoint

A checkpoint is written to `step_<N>.tmp/`, checksummed, renamed to `step_<N>/` when every rank
has written its part, and only then named in `latest`; beyond `keep`, this run's oldest
unprotected checkpoints are deleted (by write order, see trainer.checkpoint.record). What goes
inside is the engine's (`write_checkpoint`): DCP's files of parameter-name keyed states for plain
and FSDP2 models alike, so loading reshards them (trainer.checkpoint.load), or an engine's own.
"""

from __future__ import annotations

import logging
import shutil
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from data.atomic import atomic_write_bytes, is_disk_full
from parallel.collective import all_true, barrier, several_ranks
from trainer.checkpoint.errors import CheckpointError
from trainer.checkpoint.fingerprint import Fingerprint
from trainer.checkpoint.load import Checkpointable, require_checkpointable
from trainer.checkpoint.record import (
    LATEST,
    CommitRecord,
    checksum_files,
    list_checkpoints,
    next_sequence,
)

log = logging.getLogger("trainer.checkpoint")
# DCP warns that it assumes a single process when no process group exists: that is meant here
# (also from the thread of an asynchronous save, so a filter rather than a catch_warnings block)
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*single process")
PREFIX = "step_"


def step_dir(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:08d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """Finished checkpoints, last written first (temporaries are never listed)."""
    return [c.path for c in list_checkpoints(root)]


class Checkpointer:
    """Writes checkpoints under `root` for the run `run_id`. With `async_save`, DCP snapshots the
    state and writes it in the background (on a process group of its own, so its collectives
    never interleave with training's) while training goes on; the checkpoint is committed once
    every rank's write has finished: polled at step boundaries, awaited before the next save and
    at the end."""

    def __init__(
        self,
        root: Path,
        rank: int,
        keep: int,
        async_save: bool = False,
        run_id: str = "",
        fingerprint: Fingerprint | None = None,
        timeout_s: float = 300.0,
    ):
        self.root, self.rank, self.keep, self.async_save = root, rank, keep, async_save
        self.run_id, self.fingerprint = run_id, fingerprint
        self.last_committed: Path | None = None
        self._pending: tuple[Future, Path, Path] | None = None
        # a gloo group of its own: the background write's gathers must not meet FSDP's
        self._group = None
        if async_save and several_ranks():  # gloo's default would be 30 minutes
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def save(self, step: int, state: Checkpointable, extra: dict[str, Any]) -> Path:
        """Write `state` (the engine: its own files, model + optimizer) and `extra` (this rank's
        trainer state) as the checkpoint of `step`."""
        require_checkpointable(state)
        self.wait()
        final = step_dir(self.root, step)
        tmp = final.with_name(final.name + ".tmp")
        with _disk_full_is_one_line(self, final, tmp):
            _agreed(lambda: _fresh_dir(tmp) if self.rank == 0 else None)
            tmp.mkdir(parents=True, exist_ok=True)  # other nodes may not see rank 0's mkdir yet
            identity = {"run_id": self.run_id}
            if self.fingerprint is not None:
                identity["fingerprint"] = self.fingerprint.to_dict()
            _agreed(lambda: torch.save(extra | identity, tmp / f"trainer_rank{self.rank}.pt"))
            # the engine's collective write (DCP, possibly in the background; DeepSpeed's own)
            future = state.write_checkpoint(tmp, self.async_save, self._group)
            if future is not None:
                self._pending = (future, tmp, final)
                return final
            self._commit(tmp, final)
        return final

    def poll(self) -> Path | None:
        """Commit a finished background write once every rank's has finished."""
        if self._pending is None or not all_true(self._pending[0].done()):
            return None
        return self.wait()

    def wait(self) -> Path | None:
        """Finish and commit the background write, if there is one."""
        if self._pending is None:
            return None
        future, tmp, final = self._pending
        self._pending = None
        with _disk_full_is_one_line(self, final, tmp):
            future.result()
            self._commit(tmp, final)
        return final

    def _commit(self, tmp: Path, final: Path) -> None:
        barrier()  # every rank's files are written
        files = checksum_files(tmp)
        if self.rank == 0:
            _agreed(lambda: self._publish(tmp, final, files))
        else:
            _agreed(lambda: None)
        self.last_committed = final

    def _publish(self, tmp: Path, final: Path, files: dict[str, str]) -> None:
        step = int(final.name[len(PREFIX) :])
        CommitRecord(self.run_id, next_sequence(self.root), step, files).write(tmp)
        if final.exists():  # a re-save of the same step (after a resume or a fallback)
            theirs = _record_or_none(final)
            if theirs is not None and theirs.run_id != self.run_id:
                raise CheckpointError(
                    f"{final} was written by another run ({theirs.run_id}): not overwriting it"
                )
            shutil.rmtree(final)
        tmp.rename(final)
        atomic_write_bytes(self.root / LATEST, (final.name + "\n").encode())
        mine = [
            c
            for c in list_checkpoints(self.root, warn=False)
            if c.record is not None and c.record.run_id == self.run_id and not c.protected
        ]
        for old in mine[self.keep :]:  # newest first: `final` is never among them
            shutil.rmtree(old.path, ignore_errors=True)


def _fresh_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)


def _record_or_none(path: Path) -> CommitRecord | None:
    try:
        return CommitRecord.read(path)
    except ValueError:
        return None


def _agreed(action) -> None:
    """Run `action` on this rank; every rank learns whether all succeeded (no rank waits in a
    collective for one that failed), and this rank's own error is raised."""
    error: BaseException | None = None
    try:
        action()
    except Exception as err:  # re-raised below, after the agreement
        error = err
    if not all_true(error is None):
        if error is not None:
            raise error
        raise CheckpointError("another rank failed to write its part of the checkpoint")


@contextmanager
def _disk_full_is_one_line(owner: Checkpointer, final: Path, tmp: Path) -> Iterator[None]:
    """A write that runs out of space ends with one line naming the place and what was kept;
    the partial temporary directory is removed."""
    try:
        yield
    except BaseException as err:  # DCP's CheckpointException is a BaseException
        if not is_disk_full(err):
            raise
        if owner.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        kept = complete_checkpoints(owner.root)
        what = f"the newest complete checkpoint is {kept[0]}" if kept else "no checkpoint yet"
        raise CheckpointError(
            f"no space left on {owner.root} while writing {final.name}; {what}. "
            f"Free space and run the same command again: it resumes from there"
        ) from None
