"""Requeue a SLURM job after a stop signal (pre-timeout signal or preemption).

The loop has saved a checkpoint on every rank when this runs. Rank 0 then asks SLURM to put the
job back in the queue (`scontrol requeue $SLURM_JOB_ID`); the new run has the same job id, so
the same run directory (runs/slurm-<id>), and `resume=auto` continues from the checkpoint.
Nothing happens outside SLURM or for a job submitted without `--requeue` (Requeue=0).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess

import torch.distributed as dist

from trainer.runtime import Ranks

log = logging.getLogger("trainer")


def requeue_slurm_job(ranks: Ranks) -> bool:
    """Requeue this job (rank 0, after every rank has saved); True when SLURM accepted it."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return False
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # every rank is past its checkpoint before the job is torn down
    if not ranks.is_main:
        return False
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        log.error("cannot requeue job %s: scontrol is not on PATH; resubmit it to resume", job)
        return False
    if not _requeue_allowed(scontrol, job):
        log.info("job %s was submitted without --requeue: not requeued; resubmit to resume", job)
        return False
    out = subprocess.run([scontrol, "requeue", job], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        log.error("scontrol requeue %s failed: %s", job, (out.stderr or out.stdout).strip())
        return False
    log.info("job %s requeued: it resumes from this checkpoint when it starts again", job)
    return True


def _requeue_allowed(scontrol: str, job: str) -> bool:
    out = subprocess.run(
        [scontrol, "show", "job", "-o", job], capture_output=True, text=True, check=False
    )
    return out.returncode == 0 and " Requeue=1" in f" {out.stdout}"
