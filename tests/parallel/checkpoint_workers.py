"""What each rank runs in the distributed checkpoint tests (importable, for spawned ranks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.parallel.workers import small_model
from trainer.checkpoint.errors import CheckpointError
from trainer.checkpoint.load import load_checkpoint
from trainer.checkpoint.save import Checkpointer


def one_rank_cannot_read(rank: int, directory: str) -> dict[str, Any]:
    """Save a checkpoint on all ranks, then load it while rank 1 cannot read its share of the
    files: every rank must reach the same verdict (and none may wait in a collective)."""
    from model.transformer import build_model
    from parallel.engine import ModuleState
    from trainer.checkpoint import record

    model = build_model(small_model(), seed=0)
    state = ModuleState(model, torch.optim.AdamW(model.parameters()))
    root = Path(directory)
    saved = Checkpointer(root, rank, keep=2, run_id="run").save(1, state, {"step": 1})
    if rank == 1:

        def unreadable(path: Path, chunk: int = 0) -> str:
            raise OSError(5, "Input/output error", str(path))

        record.file_checksum = unreadable
    try:
        load_checkpoint(saved, state, rank)
    except CheckpointError as err:
        return {"refused": True, "message": str(err)}
    return {"refused": False, "message": ""}
