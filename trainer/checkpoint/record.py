"""What a checkpoint says about itself (`commit.json`), and the list of checkpoints of a run.

    checkpoints/step_00000100/commit.json   run id, write sequence, step, checksum of every file
    checkpoints/step_00000100/.protected    (optional) kept whatever `checkpoint.keep` says

The record is written into the temporary directory after every rank's files, so the rename that
publishes a checkpoint also publishes its checksums. Checksums are computed and verified by all
ranks together, each taking every W-th file, so no rank reads the whole checkpoint.

Order is the run's own write order (`sequence`: one more than any checkpoint already there),
not the step number: leftovers with higher steps (an abandoned branch after a fallback) are
older than what the run writes next. Directories without a record (written before records
existed, or not by the trainer at all) sort below every recorded one, by step.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from data.atomic import atomic_write_json
from data.manifest import file_checksum
from parallel.collective import all_true, from_main, rank_and_size, to_main

log = logging.getLogger("trainer.checkpoint")
RECORD = "commit.json"
LATEST = "latest"  # checkpoints/latest: the name of the newest complete checkpoint
PROTECTED = ".protected"
NAME = re.compile(r"step_(\d+)")


@dataclass(frozen=True)
class CommitRecord:
    run_id: str
    sequence: int  # write order within the checkpoints directory (1, 2, ...)
    step: int
    files: dict[str, str]  # file path relative to the checkpoint -> checksum (xxh3_128)

    @classmethod
    def read(cls, directory: Path) -> CommitRecord | None:
        """The record, None when there is none; ValueError when it is unreadable."""
        path = directory / RECORD
        if not path.is_file():
            return None
        try:
            raw = json.loads(path.read_text())
            return cls(str(raw["run_id"]), int(raw["sequence"]), int(raw["step"]), raw["files"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path} is unreadable ({type(err).__name__})") from None

    def write(self, directory: Path) -> None:
        atomic_write_json(directory / RECORD, asdict(self))


@dataclass(frozen=True)
class Listed:
    """A checkpoint directory found under checkpoints/."""

    path: Path
    step: int
    record: CommitRecord | None
    problem: str = ""  # why the record could not be read

    @property
    def order(self) -> tuple[int, int]:
        return (self.record.sequence if self.record else -1, self.step)

    @property
    def protected(self) -> bool:
        return (self.path / PROTECTED).is_file()


def list_checkpoints(root: Path, warn: bool = True) -> list[Listed]:
    """Checkpoints under `root`, newest (last written) first; temporaries are never listed and
    names other than step_<N> are ignored (with a warning)."""
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        if not path.is_dir() or path.name.endswith(".tmp"):
            continue
        match = NAME.fullmatch(path.name)
        if match is None:
            if warn:
                log.warning("ignoring %s: not a checkpoint name (step_<N>)", path)
            continue
        try:
            found.append(Listed(path, int(match.group(1)), CommitRecord.read(path)))
        except ValueError as err:
            found.append(Listed(path, int(match.group(1)), None, str(err)))
    return sorted(found, key=lambda c: c.order, reverse=True)


def next_sequence(root: Path) -> int:
    return 1 + max(
        (c.record.sequence for c in list_checkpoints(root, False) if c.record), default=0
    )


def protect(directory: Path, reason: str) -> None:
    (directory / PROTECTED).write_text(reason + "\n")


def checkpoint_files(directory: Path) -> list[str]:
    """Every file under `directory`, in its folders too (an engine's own format keeps its files
    in one: `deepspeed/`), as sorted paths relative to it."""
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file())


def checksum_files(directory: Path) -> dict[str, str]:
    """Checksums of every file under `directory` (checkpoint_files), computed by all ranks
    together; the full table on rank 0 (an empty one elsewhere). A rank that cannot read its
    share makes every rank raise (no rank is left waiting in a collective)."""
    names = from_main(checkpoint_files(directory))
    rank, size = rank_and_size()
    mine: dict[str, str] = {}
    problem = ""
    try:
        mine = {name: file_checksum(directory / name) for name in names[rank::size]}
    except OSError as err:
        problem = f"cannot read {err.filename}: {err.strerror}"
    if not all_true(not problem):
        raise OSError(problem or "another rank could not read its part of the checkpoint")
    parts = to_main(mine)
    return {k: v for part in parts for k, v in part.items()} if parts else {}


def file_problem(directory: Path, files: dict[str, str]) -> str:
    """What is wrong with this rank's share of the recorded files ("" when nothing); no
    collective inside: the caller agrees on the outcome once."""
    rank, size = rank_and_size()
    for name in sorted(files)[rank::size]:
        path = directory / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            return f"its record names {name!r}, outside the checkpoint"
        try:
            if not path.is_file():
                return f"{name} is missing"
            if file_checksum(path) != files[name]:
                return f"{name} does not match its checksum"
        except OSError as err:
            return f"{name} cannot be read ({err.strerror})"
    return ""
