"""wandb reporting (rank 0 only): `logging.wandb=disabled|offline|online`.

The run id is kept in checkpoints and passed back on resume (`resume="allow"`), so one training
run is one continuous wandb run across restarts. Offline runs land in `<run dir>/wandb/` and can
be uploaded later with `wandb sync`.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path
from typing import Any

from trainer.config import LoggingConfig

log = logging.getLogger("trainer.wandb")


class WandbRun:
    def __init__(
        self,
        cfg: LoggingConfig,
        run_dir: Path,
        config: dict[str, Any],
        run_id: str | None,
        is_main: bool,
    ):
        self.run: Any = None
        self.id = run_id
        if cfg.wandb == "disabled" or not is_main:
            return
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        self.id = run_id or uuid.uuid4().hex[:8]  # wandb ids: lowercase letters and digits
        self.run = wandb.init(
            mode=cfg.wandb,
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.name or run_dir.name,
            id=self.id,
            resume="allow",
            dir=str(run_dir),
            config=config,
        )
        log.info("wandb %s run %s (%s)", cfg.wandb, self.id, getattr(self.run, "dir", run_dir))

    def log(self, row: dict[str, Any], step: int) -> None:
        if self.run is not None:
            self.run.log({k: v for k, v in row.items() if k != "step"}, step=step)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
