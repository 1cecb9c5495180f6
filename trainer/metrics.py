"""`metrics.jsonl` (one JSON object per logged step) and process memory.

The keys `step, loss, lr, grad_norm, tokens, tokens_per_s, mfu` are always present on training
rows and `val_loss` on evaluation rows (the run directory contract in README.md). On resume the file is cut back to
the checkpoint's step, so a killed run's rows past it are not counted twice.
"""

from __future__ import annotations

import json
import math
import os
import resource
from pathlib import Path
from typing import Any

import torch

from data.atomic import atomic_write_bytes


class MetricsFile:
    def __init__(self, path: Path, enabled: bool):
        self.path, self.enabled = path, enabled

    def truncate_after(self, step: int) -> None:
        """Keep the rows of steps <= `step` (those the resumed checkpoint has seen); a torn last
        line (the process was killed mid-write) is dropped."""
        if not self.enabled or not self.path.is_file():
            return
        kept = [json.dumps(row) for row in self.rows() if row.get("step", 0) <= step]
        atomic_write_bytes(self.path, ("\n".join(kept) + "\n" if kept else "").encode())

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: _jsonable(v) for k, v in row.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(clean) + "\n")

    def rows(self) -> list[dict[str, Any]]:
        """Every complete row; a line that is not JSON (torn by a kill) is skipped."""
        if not self.path.is_file():
            return []
        out = []
        for line in self.path.read_text(errors="replace").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                out.append(row)
        return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "nan" / "inf": JSON has no literal for them
    return value


def memory_bytes(device: torch.device) -> tuple[str, int]:
    """("cuda_max_allocated", bytes) on GPU, else ("rss", current resident set bytes)."""
    if device.type == "cuda":
        return "cuda_max_allocated", torch.cuda.max_memory_allocated(device)
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return "rss", pages * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: peak RSS (kilobytes on Linux, bytes on macOS)
        return "rss", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
