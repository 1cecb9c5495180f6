"""Atomic file writes: write a temporary sibling, flush it to disk, then rename over the target.

A reader therefore sees either the old file or the complete new one, never a partial write.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any


def temporary_sibling(path: Path) -> Path:
    """A name beside `path` that no reader looks for (`.name.tmp-<pid>`)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = temporary_sibling(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def remove_temporaries(directory: Path) -> None:
    """Delete temporary siblings left by an interrupted writer."""
    for stale in directory.glob(".*.tmp-*"):
        stale.unlink(missing_ok=True)


def is_disk_full(err: BaseException | None) -> bool:
    """ENOSPC (or a full quota) anywhere in an exception's chain, or torch's zip writer's
    short-write error ("unexpected pos"), which is what a full disk looks like from torch.save."""
    seen = 0
    while err is not None and seen < 20:
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(err)
        if "No space left" in text or "unexpected pos" in text or "Disk quota" in text:
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False
