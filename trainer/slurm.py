"""Requeue a SLURM job after a stop signal (pre-timeout signal or preemption).

The loop has saved a checkpoint on every rank when this runs. Rank 0 then asks SLURM to put the
job back in the queue (`scontrol requeue $SLURM_JOB_ID`); the new run has the same job id, so
the same run directory (runs/slurm-<id>), and `resume=auto` continues from the checkpoint.
Only after SIGUSR2 (the templates' pre-timeout signal), not after SIGTERM: a user's `scancel`
must end the job, and a preempting cluster with PreemptMode=REQUEUE requeues by itself. Nothing
happens outside SLURM, for a job submitted without `--requeue` (Requeue=0), or once the run has
reached max_steps.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess

from parallel.collective import barrier, from_main
from trainer.runtime import Ranks

log = logging.getLogger("trainer")


def requeue_slurm_job(ranks: Ranks) -> bool:
    """Requeue this job: rank 0, after every rank has saved, while every rank waits (under
    `srun --kill-on-bad-exit`, a rank that left early could get rank 0 killed before it asks).
    True on every rank when SLURM accepted it."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return False
    barrier()  # every rank is past its checkpoint before the job is torn down
    # the others wait for rank 0's answer
    return bool(from_main(_requeue(job) if ranks.is_main else False))


def _requeue(job: str) -> bool:
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
