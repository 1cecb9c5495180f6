"""What a person watching a run sees: where it is (step/total, elapsed, ETA), and at the end what
it achieved and where its results are.

`RunClock` counts this process's training time (evaluation and saving excluded, as in the
tokens/s of each log row) so that the ETA and the final tokens/s describe training itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from trainer.console import console


def clock(seconds: float) -> str:
    """4321.5 -> '1:12:01'."""
    seconds = max(0, round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


@dataclass
class RunClock:
    """This process's progress from `first_step` (where it started or resumed) on."""

    first_step: int
    started: float = field(default_factory=time.perf_counter)
    train_seconds: float = 0.0  # the log windows' training time (no evaluation or saving)
    tokens: int = 0  # tokens trained in those windows

    def add_window(self, seconds: float, tokens: int) -> None:
        self.train_seconds += seconds
        self.tokens += tokens

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def eta(self, step: int, total: int) -> float | None:
        """Seconds of training left at this process's pace (None before a step was timed)."""
        done = step - self.first_step
        if done <= 0 or self.train_seconds <= 0:
            return None
        return (total - step) * self.train_seconds / done

    def where(self, step: int, total: int) -> str:
        """'elapsed 0:01:23  ETA 0:40:12' for a log line."""
        eta = self.eta(step, total)
        return f"elapsed {clock(self.elapsed())}  ETA {clock(eta) if eta is not None else '?'}"

    def tokens_per_s(self) -> float:
        return self.tokens / self.train_seconds if self.train_seconds > 0 else 0.0


def progress_bar(enabled: bool) -> Progress:
    """The bar a terminal shows (rank 0, logging.progress): loss, bar, step/total, times."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        disable=not (enabled and console.is_terminal),
        transient=False,
    )


def summary(
    steps: int,
    run_clock: RunClock,
    skipped: int,
    val_loss: float | None,
    run_dir: Path,
    checkpoint: Path | None,
) -> list[str]:
    """The lines that end a finished run: what it achieved and where everything is."""
    trained = steps - run_clock.first_step
    pace = (
        f"in {clock(run_clock.elapsed())} ({run_clock.tokens_per_s():,.0f} tokens/s of "
        f"training), {skipped} skipped steps"
    )
    if trained <= 0:  # resumed at trainer.max_steps: nothing was left to train
        first = (
            f"nothing to train: the run is already at step {steps}, which trainer.max_steps does "
            "not exceed (raise trainer.max_steps to train on)"
        )
    elif run_clock.first_step:
        first = f"done: step {steps} ({trained} steps from step {run_clock.first_step} {pace})"
    else:
        first = f"done: {steps} steps {pace}"
    lines = [first]
    if val_loss is not None:
        lines.append(f"final validation loss {val_loss:.4f}")
    lines.append(f"run directory {run_dir}: train.log, metrics.jsonl, loss.png")
    if checkpoint is not None:
        lines.append(f"last checkpoint {checkpoint} (resume=auto continues from it)")
    return lines
