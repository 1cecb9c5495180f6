"""Loading a checkpoint and choosing which one to resume (the reading half of trainer.checkpoint).

Every rank takes the same decisions: the commit record, the checksums and the small per-rank
file are checked first, each rank working out its own verdict, then agreed on in one collective
before DCP's collective load. A checkpoint whose model or optimizer does not fit is refused
(`CheckpointConflict`, exit 2) before any weight is read; only I/O, format and checksum
problems make one "damaged", and `resume=auto` then falls back to the one before it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from parallel.checkpoint_format import DCP, CheckpointFormat, DCPSource
from parallel.collective import barrier, from_main, rank_and_size, worst_over_ranks
from parallel.deepspeed.safe_load import UnsafeFileError, vet_folder
from parallel.engine import CheckpointRefusal
from trainer.checkpoint.errors import CheckpointConflict, CheckpointError, UnsafeCheckpointError
from trainer.checkpoint.fingerprint import Fingerprint
from trainer.checkpoint.record import LATEST, CommitRecord, Listed, file_problem, list_checkpoints
from trainer.checkpoint.safe_load import (
    METADATA,
    SafePlanner,
    SafeReader,
    load_plain,
    read_dcp_metadata,
)
from trainer.distributed import is_collective_timeout

log = logging.getLogger("trainer.checkpoint")
# what a damaged checkpoint raises: DCP's CheckpointException derives from BaseException
LOAD_ERRORS = (Exception, CheckpointException)


# what checkpoints save and load: a training engine, or parallel.engine.ModuleState(model,
# optimizer); each writes and reads its own files (parallel.checkpoint_format)
Checkpointable = CheckpointFormat


def require_checkpointable(target: object) -> None:
    """A TypeError, before any file is touched, for an object without the checkpoint methods
    (an object with only state_dict(): a programming error, never a damaged checkpoint)."""
    if not isinstance(target, CheckpointFormat):
        raise TypeError(
            f"{type(target).__name__} cannot be checkpointed: subclass "
            "parallel.checkpoint_format.CheckpointFormat (DCP files of its state_dict())"
        )


def format_of(path: Path) -> str | None:
    """The format a step directory was written in: DCP (its .metadata), an engine's folder,
    or None (neither: incomplete)."""
    if (path / METADATA).is_file():
        return DCP
    folders = [p.name for p in path.iterdir() if p.is_dir()] if path.is_dir() else []
    return folders[0] if len(folders) == 1 else None


@dataclass
class Restored:
    path: Path
    extra: dict[str, Any]  # step, loader state, rng, run and wandb ids, ...


def load_checkpoint(
    path: Path,
    target: Checkpointable,
    rank: int,
    fingerprint: Fingerprint | None = None,
    verify: bool = True,
) -> dict[str, Any]:
    """Load `target`'s model and optimizer in place (DCP reshards them to this run's layout); returns the
    extra state saved by this rank, or by rank 0 when the checkpoint came from fewer ranks
    (the loader position is global, so it holds for any number of ranks).

    Every rank takes the same decisions: the record, the checksums and the small per-rank file
    are checked and agreed on before DCP's collective load, whose errors reach every rank."""
    problem, unsafe = "", False
    extra: dict[str, Any] = {}
    metadata = None
    require_checkpointable(target)
    form = target.checkpoint_format
    _refuse_other_format(path, form)
    try:
        extra, metadata = read_checked(path, rank, verify, form)
    except UnsafeCheckpointError as err:
        problem, unsafe = str(err), True
    except CheckpointError as err:  # a missing file, a checksum: its own words
        problem = str(err)
    except Exception as err:  # I/O, format: this rank's view; agreed on below
        problem = _brief(err)
    verdict, problem = worst_over_ranks(2 if unsafe else 1 if problem else 0, problem)
    if verdict == 2:  # the one agreement, with the reason of the rank that found it
        raise UnsafeCheckpointError(problem)
    if verdict == 1:
        raise CheckpointError(problem)
    if fingerprint is not None and (differences := fingerprint.differences(extra)):
        raise CheckpointConflict(
            f"{path} was written with other settings ({'; '.join(differences)}). Resume with "
            f"the run's original overrides, or start a new run: resume=none and another "
            f"hydra.run.dir"
        )
    if conflict := target.checkpoint_conflict(path):
        raise CheckpointConflict(conflict)
    source = DCPSource(SafeReader(str(path), metadata), SafePlanner()) if form == DCP else None
    try:
        target.read_checkpoint(path, source)  # the engine's collective load
    except CheckpointRefusal as err:  # the engine cannot use it here: not damage
        raise CheckpointConflict(str(err)) from err
    return extra


def read_checked(
    path: Path, rank: int, verify: bool = True, form: str = DCP
) -> tuple[dict[str, Any], Any]:
    """(this rank's trainer state, DCP's metadata or None for another format) of the checkpoint
    at `path`, after checking its record and this rank's share of the checksums; refuses crafted
    files. No collective: callers with several ranks agree on the outcome."""
    if form == DCP and not (path / METADATA).is_file():
        raise CheckpointError(f"{path} is incomplete (no .metadata)")
    if form != DCP and not (path / form).is_dir():
        raise CheckpointError(f"{path} is incomplete (no {form}/)")
    record = CommitRecord.read(path)
    if record is None:
        log.warning("%s has no commit.json (an older checkpoint): files not verified", path)
    elif verify and (problem := file_problem(path, record.files)):
        raise CheckpointError(problem)
    metadata = None
    if form == DCP:
        metadata = read_dcp_metadata(path / METADATA)  # refuses a crafted pickle by name
    else:  # an engine's own files, this rank's share: refused by name if crafted
        try:
            vet_folder(path / form, *rank_and_size())
        except UnsafeFileError as err:
            raise UnsafeCheckpointError(str(err)) from None
    extra_path = path / f"trainer_rank{rank}.pt"
    if not extra_path.is_file():
        extra_path = path / "trainer_rank0.pt"
        if not extra_path.is_file():
            raise CheckpointError(f"{path} is incomplete (no trainer_rank0.pt)")
    return load_plain(extra_path), metadata


def read_states(
    state: dict[str, Any], path: Path, metadata: Any = None, no_dist: bool = False
) -> None:
    """DCP's load of `state` (resharded to its layout) through the safe reader and planner;
    `no_dist`: this process alone (whole tensors), no collective."""
    reader, planner = SafeReader(str(path), metadata), SafePlanner()
    dcp.load(state, storage_reader=reader, planner=planner, no_dist=no_dist)


def resume(
    resume_from: str,
    root: Path,
    target: Checkpointable,
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
    require_checkpointable(target)  # before the loop below takes a TypeError for damage
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
            target,
            rank,
            fingerprint,
            verify,
        ), []
    failed: list[Path] = []
    for listed in listing:
        try:
            extra = load_checkpoint(listed.path, target, rank, fingerprint, verify)
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


def _refuse_other_format(path: Path, form: str) -> None:
    """A checkpoint another engine wrote is a conflict (not damage: no fallback past it)."""
    found = format_of(path)
    if found is None or found == form:
        return
    engines = {DCP: "parallel.engine=fsdp2 (DCP)", "deepspeed": "parallel.engine=deepspeed"}
    raise CheckpointConflict(
        f"{path} was written by {engines.get(found, found)}, and this run uses "
        f"{engines.get(form, form)}: resume with the engine that wrote it, or start a new run "
        f"from its weights: init_from={path}"
    )


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
    target: Checkpointable,
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
        return Restored(path, load_checkpoint(path, target, rank, fingerprint, verify))
    except CheckpointConflict:
        raise
    except LOAD_ERRORS as err:
        _raise_if_not_damage(err)
        raise CheckpointError(f"resume={path} cannot be loaded: {_brief(err)}") from err


def _brief(err: BaseException) -> str:
    """One line: DCP's exceptions carry every rank's whole traceback in their text."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[-1] if lines else ''}"
