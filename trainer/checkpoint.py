"""DCP checkpoints that appear only when complete and verified, and resume from the newest good one.

    checkpoints/step_00000100/   .metadata + *.distcp (model and optimizer, via DCP)
                                 trainer_rank<R>.pt (step, loader, RNG states, run id, configs)
                                 commit.json (run id, write order, checksum of every file)
    checkpoints/latest           the name of the newest complete checkpoint

A checkpoint is written to `step_<N>.tmp/`, checksummed, renamed to `step_<N>/` when every rank
has written its part, and only then named in `latest`; beyond `keep`, this run's oldest
unprotected checkpoints are deleted (by write order, see trainer.checkpoint_record). Model and
optimizer states come from `torch.distributed.checkpoint.state_dict`, which gives parameter-name
keyed states for plain and FSDP2 models alike, so DCP can reshard them on load.

Loading refuses, before reading any weights, a checkpoint whose model or optimizer structure
differs from the run's (`CheckpointConflict`, exit 2); only I/O, format and checksum problems
make a checkpoint "damaged", and `resume=auto` then falls back to the one before it.
"""

from __future__ import annotations

import errno
import logging
import shutil
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from data.atomic import atomic_write_bytes
from trainer.checkpoint_errors import CheckpointConflict, CheckpointError, UnsafeCheckpointError
from trainer.checkpoint_record import (
    CommitRecord,
    Listed,
    checksum_files,
    file_problem,
    list_checkpoints,
    next_sequence,
)
from trainer.collective import all_true, barrier, from_main, max_over_ranks, several_ranks
from trainer.distributed import is_collective_timeout
from trainer.fingerprint import Fingerprint
from trainer.safe_load import METADATA, SafePlanner, SafeReader, load_plain, read_dcp_metadata

log = logging.getLogger("trainer.checkpoint")
LATEST = "latest"
# what a damaged checkpoint raises: DCP's CheckpointException derives from BaseException
LOAD_ERRORS = (Exception, CheckpointException)
# DCP warns that it assumes a single process when no process group exists: that is meant here
# (also from the thread of an asynchronous save, so a filter rather than a catch_warnings block)
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*single process")
PREFIX = "step_"


@dataclass
class Restored:
    path: Path
    extra: dict[str, Any]  # step, loader state, rng, run and wandb ids, ...


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

    def save(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any]
    ) -> Path:
        self.wait()
        final = step_dir(self.root, step)
        tmp = final.with_name(final.name + ".tmp")
        with _disk_full_is_one_line(self, final, tmp):
            _agreed(lambda: _fresh_dir(tmp) if self.rank == 0 else None)
            tmp.mkdir(parents=True, exist_ok=True)  # other nodes may not see rank 0's mkdir yet
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd}
            identity = {"run_id": self.run_id}
            if self.fingerprint is not None:
                identity["fingerprint"] = self.fingerprint.to_dict()
            _agreed(lambda: torch.save(extra | identity, tmp / f"trainer_rank{self.rank}.pt"))
            if self.async_save:
                future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._group)
                self._pending = (future, tmp, final)
                return final
            dcp.save(state, checkpoint_id=str(tmp))
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
        if not _is_disk_full(err):
            raise
        if owner.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        kept = complete_checkpoints(owner.root)
        what = f"the newest complete checkpoint is {kept[0]}" if kept else "no checkpoint yet"
        raise CheckpointError(
            f"no space left on {owner.root} while writing {final.name}; {what}. "
            f"Free space and run the same command again: it resumes from there"
        ) from None


def _is_disk_full(err: BaseException | None) -> bool:
    """ENOSPC anywhere in the chain, or torch's zip writer's short-write error."""
    seen = 0
    while err is not None and seen < 20:
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(err)
        if "No space left" in text or "unexpected pos" in text or "Disk quota" in text:
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


def load_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
    fingerprint: Fingerprint | None = None,
    verify: bool = True,
) -> dict[str, Any]:
    """Load model and optimizer in place (DCP reshards them to this run's layout); returns the
    extra state saved by this rank, or by rank 0 when the checkpoint came from fewer ranks
    (the loader position is global, so it holds for any number of ranks).

    Every rank takes the same decisions: the record, the checksums and the small per-rank file
    are checked and agreed on before DCP's collective load, whose errors reach every rank."""
    problem, unsafe = "", False
    extra: dict[str, Any] = {}
    try:
        _check_files(path, verify)
        extra = _read_extra(path, rank)
    except UnsafeCheckpointError as err:
        problem, unsafe = str(err), True
    except Exception as err:  # I/O, format: this rank's view; agreed on below
        problem = _brief(err)
    verdict = max_over_ranks(2 if unsafe else 1 if problem else 0)  # the one agreement
    if verdict == 2:
        raise UnsafeCheckpointError(problem or f"{path} was refused on another rank")
    if verdict == 1:
        raise CheckpointError(f"{path} is incomplete or damaged ({problem or 'on another rank'})")
    if fingerprint is not None and (differences := fingerprint.differences(extra)):
        raise CheckpointConflict(
            f"{path} was written with other settings ({'; '.join(differences)}). Resume with "
            f"the run's original overrides, or start a new run: resume=none and another "
            f"hydra.run.dir"
        )
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafePlanner())
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    return extra


def _check_files(path: Path, verify: bool) -> None:
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{path} is incomplete (no .metadata)")
    record = CommitRecord.read(path)
    if record is None:
        log.warning("%s has no commit.json (an older checkpoint): files not verified", path)
    elif verify and (problem := file_problem(path, record.files)):
        raise CheckpointError(problem)
    read_dcp_metadata(path / METADATA)  # refuses a crafted pickle with its own message


def _read_extra(path: Path, rank: int) -> dict[str, Any]:
    extra_path = path / f"trainer_rank{rank}.pt"
    if not extra_path.is_file():
        extra_path = path / "trainer_rank0.pt"
        if not extra_path.is_file():
            raise CheckpointError(f"{path} is incomplete (no trainer_rank0.pt)")
    return load_plain(extra_path)


def resume(
    resume_from: str,
    root: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
    fingerprint: Fingerprint | None = None,
    verify: bool = True,
) -> tuple[Restored | None, list[Path]]:
    """(what was restored, the checkpoints that failed to load on the way).

    `auto`: the newest checkpoint under `root` that loads (falling back past damaged ones, all
    ranks together); `none`: start fresh, which a run directory holding checkpoints refuses;
    anything else: that checkpoint directory, which must load. A failed load may have left
    weights half-read: the caller re-initializes when it starts from scratch after one. A
    refusal (settings, a crafted file), a collective timeout or Ctrl-C is raised, never taken
    for damage."""
    listing: list[Listed] = from_main(list_checkpoints(root))  # listings may differ per node
    if resume_from == "none":
        if listing:
            raise CheckpointConflict(
                f"resume=none, but {root} already holds checkpoints (newest {listing[0].path.name})"
                f": a new run there would mix two runs. Pass another hydra.run.dir for a new "
                f"run, or resume=auto to continue this one"
            )
        return None, []
    if resume_from != "auto":
        return _resume_from_path(
            Path(resume_from).expanduser(),
            root,
            listing,
            model,
            optimizer,
            rank,
            fingerprint,
            verify,
        ), []
    failed: list[Path] = []
    for listed in listing:
        try:
            extra = load_checkpoint(listed.path, model, optimizer, rank, fingerprint, verify)
        except CheckpointConflict:
            raise
        except LOAD_ERRORS as err:
            _raise_if_not_damage(err)
            log.warning(
                "checkpoint %s is damaged (%s); trying the one before it", listed.path, _brief(err)
            )
            failed.append(listed.path)
            continue
        return Restored(listed.path, extra), failed
    return None, failed


def set_aside(failed: list[Path], run_dir: Path, is_main: bool) -> Path:
    """Move checkpoints that did not load (and the metrics they belong to) out of the run's
    way, into `<run dir>/unloadable-<n>/`: a fresh start then neither mixes with them nor
    deletes them. Returns that directory."""
    n = 1
    while (run_dir / f"unloadable-{n}").exists():
        n += 1
    target = from_main(run_dir / f"unloadable-{n}")
    if is_main:
        target.mkdir(parents=True)
        for path in failed:
            if path.exists():
                path.rename(target / path.name)
        for name in ("metrics.jsonl", "loss.png"):
            if (run_dir / name).exists():
                (run_dir / name).rename(target / name)
        (run_dir / "checkpoints" / LATEST).unlink(missing_ok=True)
    barrier()
    return target


def _raise_if_not_damage(err: BaseException) -> None:
    """A timeout or Ctrl-C during a load (DCP wraps each rank's exception) is not damage."""
    for cause in [err, *getattr(err, "failures", {}).values()]:
        if isinstance(cause, KeyboardInterrupt):
            raise KeyboardInterrupt from None
        if isinstance(cause, RuntimeError) and is_collective_timeout(cause):
            raise cause


def _resume_from_path(
    path: Path,
    root: Path,
    listing: list[Listed],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
    fingerprint: Fingerprint | None,
    verify: bool,
) -> Restored:
    if not from_main(path.is_dir()):
        raise CheckpointConflict(
            f"resume={path} does not exist (pass a checkpoint directory, "
            f"checkpoints/step_<N>, or resume=auto)"
        )
    if listing and path.resolve().parent != root.resolve():
        raise CheckpointConflict(
            f"resume={path} is another run's checkpoint, but {root} already holds this run's "
            f"checkpoints (newest {listing[0].path.name}): pass another hydra.run.dir"
        )
    try:
        return Restored(path, load_checkpoint(path, model, optimizer, rank, fingerprint, verify))
    except CheckpointConflict:
        raise
    except LOAD_ERRORS as err:
        _raise_if_not_damage(err)
        raise CheckpointError(f"resume={path} cannot be loaded: {_brief(err)}") from err


def _brief(err: BaseException) -> str:
    """One line: DCP's exceptions carry every rank's whole traceback in their text."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[-1] if lines else ''}"
