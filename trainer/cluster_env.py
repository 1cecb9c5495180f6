"""Rank, world size and local rank from the launcher's environment, checked for consistency.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT.
Under plain `srun` (one task per GPU, no torchrun: launch/slurm/train_srun.sbatch, submitit)
SLURM sets SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID and SLURM_STEP_TASKS_PER_NODE; they
are mapped to torch's names here, before Hydra resolves anything rank-dependent, and
MASTER_ADDR / MASTER_PORT default to the job's first node and a port derived from the job id
(the rule the sbatch templates use). LOCAL_WORLD_SIZE is often unset under plain srun; it is
derived from SLURM_TASKS_PER_NODE. Values that disagree stop the launch with a message.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import MutableMapping
from pathlib import Path

from model.errors import ConfigError

PORT_BASE, PORT_SPAN = 20000, 20000  # MASTER_PORT = 20000 + job id % 20000


class LaunchEnvError(ConfigError):
    """The launcher's environment variables contradict each other."""


def slurm_port(job_id: str) -> int:
    """The rendezvous port of a SLURM job: the same on every node, different between jobs."""
    return PORT_BASE + int(job_id) % PORT_SPAN


def tasks_per_node(spec: str) -> list[int]:
    """SLURM_TASKS_PER_NODE ("2(x3),1") -> tasks on each node ([2, 2, 2, 1])."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise LaunchEnvError(f"SLURM_TASKS_PER_NODE={spec!r} is not SLURM's format (2(x3),1)")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def under_plain_srun(env: MutableMapping[str, str]) -> bool:
    """An srun step of several tasks and no torchrun: each task is one rank. (The batch script
    and salloc shells also carry SLURM_PROCID and SLURM_NTASKS, but no SLURM_STEP_NUM_TASKS.)"""
    return (
        "RANK" not in env
        and "SLURM_PROCID" in env
        and int(env.get("SLURM_STEP_NUM_TASKS", "1")) > 1
    )


def map_srun_env(env: MutableMapping[str, str] = os.environ) -> None:
    """Give a plain-srun task torch's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT). A no-op under torchrun or for one process."""
    if not under_plain_srun(env):
        return
    world = env["SLURM_STEP_NUM_TASKS"]
    if env.get("WORLD_SIZE", world) != world:
        raise LaunchEnvError(
            f"WORLD_SIZE={env['WORLD_SIZE']} but SLURM_STEP_NUM_TASKS={world}: unset WORLD_SIZE "
            "under srun (each SLURM task is one rank), or launch torchrun once per node"
        )
    per_node = tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env["SLURM_TASKS_PER_NODE"])
    node = int(env.get("SLURM_NODEID", "0"))
    if node >= len(per_node):
        raise LaunchEnvError(
            f"SLURM_NODEID={node} but SLURM_TASKS_PER_NODE lists {len(per_node)} nodes"
        )
    env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], world
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    env["LOCAL_WORLD_SIZE"] = str(per_node[node])
    if not env.get("MASTER_ADDR"):
        env["MASTER_ADDR"] = first_node(env)
    if not env.get("MASTER_PORT"):
        env["MASTER_PORT"] = str(slurm_port(env["SLURM_JOB_ID"]))


def first_node(env: MutableMapping[str, str]) -> str:
    """The first host of the job's node list (`scontrol show hostnames`)."""
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
    scontrol = shutil.which("scontrol")
    if not nodelist or scontrol is None:
        raise LaunchEnvError(
            "MASTER_ADDR is not set and the job's first node cannot be found "
            f"({'scontrol is not on PATH' if nodelist else 'SLURM_JOB_NODELIST is not set'}): "
            "export MASTER_ADDR=<first node> in the job script"
        )
    out = subprocess.run(
        [scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, check=False
    )
    if out.returncode != 0 or not out.stdout.split():
        raise LaunchEnvError(f"scontrol show hostnames {nodelist} failed: {out.stderr.strip()}")
    return out.stdout.split()[0]


def check_ranks(env: MutableMapping[str, str]) -> tuple[int, int, int]:
    """(rank, world size, local rank), after checking that the variables agree."""
    world = _int(env, "WORLD_SIZE", 1)
    if world > 1 and "RANK" not in env:
        raise LaunchEnvError(
            f"WORLD_SIZE={world} but RANK is not set: launch with torchrun or srun "
            "(see README, Running on a cluster)"
        )
    rank, local = _int(env, "RANK", 0), _int(env, "LOCAL_RANK", 0)
    if not 0 <= rank < world:
        raise LaunchEnvError(f"RANK={rank} is outside WORLD_SIZE={world}")
    if "LOCAL_WORLD_SIZE" in env:
        local_world = _int(env, "LOCAL_WORLD_SIZE", 1)
        if not 0 <= local < local_world or local_world > world:
            raise LaunchEnvError(
                f"LOCAL_RANK={local}, LOCAL_WORLD_SIZE={local_world} and WORLD_SIZE={world} "
                "disagree: a node cannot hold more ranks than the job, nor a rank past its node"
            )
    return rank, world, local


def _int(env: MutableMapping[str, str], key: str, default: int) -> int:
    value = env.get(key)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise LaunchEnvError(f"{key}={value!r} is not an integer") from None


def check_run_dir(overrides: list[str]) -> None:
    """The run directory (hydra.run.dir=..., else under runs/) must be creatable (one line if
    not); shared by the launcher and the trainer."""
    from trainer.run_dir import check_writable, explicit_run_dir

    explicit = explicit_run_dir(overrides)
    check_writable(Path(explicit if explicit and "${" not in explicit else "runs"))
