"""Where `python -m trainer.export` may write, and what overwrite=true may replace.

`out` is refused when it is, or lies above, the run or checkpoint being exported or the working
directory (the checkpoint's own directory is refused as a parent too: an export inside it would
be a file its checksums do not list). An existing `out` is replaced (overwrite=true) only when it
is a previous export: a directory holding the marker that every export writes (MARKER, which
lists the export's files) and nothing else, so no run, dataset or hand-made file is ever deleted.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from model.errors import ConfigError

MARKER = "lmforge_export.json"  # written last into every export: what overwrite may replace
FIX = "choose another out="


def check_out(
    out: Path, overwrite: bool, protected: dict[str, Path], checkpoints: list[Path]
) -> None:
    """Refuse (ConfigError, one line) an `out` that would replace one of `protected` (what it is
    -> its path) or one of `checkpoints`, or lie inside one of these, or an existing `out`
    that is not a previous export."""
    target = out.resolve()
    places = [(what, path.resolve()) for what, path in protected.items()]
    places += [("a checkpoint being exported", ckpt.resolve()) for ckpt in checkpoints]
    for what, path in places:
        if target == path or target in path.parents:
            where = "is" if target == path else "holds"
            raise ConfigError(
                f"out={out} {where} {what} ({path}): an export never replaces it; {FIX}"
            )
    for ckpt in checkpoints:
        if ckpt.resolve() in target.parents:
            raise ConfigError(f"out={out} lies inside a checkpoint being exported ({ckpt}); {FIX}")
    if not out.exists() and not out.is_symlink():
        return
    if not overwrite:
        raise ConfigError(
            f"out={out} exists: pass overwrite=true to replace a previous export, or {FIX}"
        )
    listed = previous_files(out)
    if listed is None:
        raise ConfigError(
            f"out={out} is not a previous export (no {MARKER}): overwrite=true replaces only a "
            f"directory trainer.export wrote; remove it yourself or {FIX}"
        )
    others = sorted(set(os.listdir(out)) - listed - {MARKER})
    if others:
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        raise ConfigError(
            f"out={out} holds files an export did not write ({shown}): overwrite=true replaces "
            f"only an export's own files; move them away or {FIX}"
        )


def previous_files(out: Path) -> set[str] | None:
    """The names a previous export in `out` wrote (its marker's list); None when `out` is not
    a real directory holding a readable marker."""
    if out.is_symlink() or not out.is_dir():
        return None
    try:
        files = json.loads((out / MARKER).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(files, list) or not all(isinstance(name, str) for name in files):
        return None
    return set(files)


def write_marker(directory: Path, checkpoint: Path, step: int, dtype: str) -> None:
    """The marker, listing every name in `directory` (written last, into the complete export)."""
    files = sorted(os.listdir(directory))
    record = {
        "written_by": "python -m trainer.export",
        "checkpoint": str(checkpoint.resolve()),
        "step": step,
        "dtype": dtype,
        "files": files,
    }
    (directory / MARKER).write_text(json.dumps(record, indent=2) + "\n")
