"""What checkpoint code raises; `exit_code` is what `python -m trainer` exits with."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was asked for, or a checkpoint could not be written."""

    exit_code = 1


class CheckpointConflict(CheckpointError):
    """The run's settings or its run directory contradict the checkpoints: refuse to start."""

    exit_code = 2


class UnsafeCheckpointError(CheckpointConflict):
    """A checkpoint file asked to build something that is not plain checkpoint data."""
