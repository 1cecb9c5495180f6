"""What an engine writes into a checkpoint, and how it reads it back: the interface, with DCP's
implementation (the FSDP2 engine, `ModuleState`).

The checkpoint code (trainer/checkpoint/) owns the transaction around it: the temporary step
directory, the trainer's per-rank files, checksums, the commit record, `latest`, the fallback
past damaged checkpoints and `keep`; it also vets the files before anything is read (no
pickle runs code). The engine owns what goes inside the step directory:

  checkpoint_format         DCP (its `.metadata` beside the shards), or the folder name of an
                            engine's own files (DeepSpeed's `deepspeed/`)
  write_checkpoint(dir, background, group)  the collective write; a Future when it finishes in
                            the background (DCP's async save over `group`), else None
  checkpoint_conflict(dir)  why this engine cannot load that checkpoint (None: it can);
                            collective, before any weight is read
  read_checkpoint(dir, source)  the collective load, resharding to this layout; `source` is the
                            checkpoint code's vetted DCP reader (None for an own format)
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch.distributed.checkpoint as dcp
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint import LoadPlanner, StorageReader

DCP = "dcp"  # the checkpoint format of engines without one of their own


@dataclass(frozen=True)
class DCPSource:
    """How DCP's files are read: a storage reader and planner that refuse crafted pickles
    (trainer.checkpoint.safe_load's), with the `.metadata` already vetted."""

    reader: StorageReader
    planner: LoadPlanner


class CheckpointFormat:
    """The checkpoint part of an engine (see the module docstring); these defaults are DCP's,
    over `state_dict()` / `load_state_dict()` in DCP's form (names that do not depend on the
    layout, so loading reshards)."""

    checkpoint_format: ClassVar[str] = DCP

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def write_checkpoint(
        self, directory: Path, background: bool = False, group: ProcessGroup | None = None
    ) -> Future | None:
        states = self.state_dict()
        if background:
            return dcp.async_save(states, checkpoint_id=str(directory), process_group=group)
        dcp.save(states, checkpoint_id=str(directory))
        return None

    def checkpoint_conflict(self, directory: Path) -> str | None:
        return None  # DCP reshards whatever the layout; the settings are the trainer's check

    def read_checkpoint(self, directory: Path, source: DCPSource | None = None) -> None:
        if source is None:
            raise ValueError(f"{directory}: DCP files are read only through a vetted source")
        state = self.state_dict()  # the template DCP fills, in this run's layout
        dcp.load(state, storage_reader=source.reader, planner=source.planner)
        self.load_state_dict(state)
