"""`python -m launch.torchrun [options] [--] [trainer overrides]`: `python -m trainer` under
torchrun, with the checks and settings a cluster launch needs.

- One node: `torchrun --standalone` (a free port on localhost).
- Several nodes: a c10d rendezvous at MASTER_ADDR:MASTER_PORT with id `--rdzv-id`; run this
  once per node. Under SLURM (one task per node, launch/slurm/train.sbatch) the node count,
  the first node, a port derived from the job id and the job id come from the job.
- `--max-restarts K`: torchrun restarts all workers when one dies, up to K times; the trainer
  resumes from the newest checkpoint of the same run directory (torchrun's run id).
- Stop signals: torchrun forwards SIGTERM, SIGINT, SIGHUP, SIGQUIT and (added here) SIGUSR2 to
  the workers, which save a checkpoint and exit; it waits `--shutdown-timeout` seconds for that
  before SIGKILL.

Before anything starts it checks: the node count against the SLURM allocation, the rendezvous
port on the node that hosts it, that the run directory is writable, and the trainer's settings
(composed and validated as `python -m trainer` does, trainer.settings). It prints the exact
command, then replaces itself with torchrun (signals sent to this process reach torchrun).
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import sys
from collections.abc import Mapping

from trainer.cluster_env import check_run_dir, first_node, slurm_port
from trainer.settings import CONFIG_ERRORS, check_settings, checkable, hydra_args

SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR2"


class LaunchError(Exception):
    """A launch that cannot work; the message names the problem and the fix."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    env = os.environ
    in_step = "SLURM_JOB_ID" in env and "SLURM_STEP_NUM_NODES" in env  # inside an srun step
    parser = argparse.ArgumentParser(prog="python -m launch.torchrun", description=__doc__)
    parser.add_argument(
        "--nproc-per-node",
        default=env.get("NPROC_PER_NODE", "auto"),
        help="processes per node; auto = the GPUs on this node, or 1 on CPU",
    )
    parser.add_argument(
        "--nnodes", type=int, default=int(env["SLURM_STEP_NUM_NODES"]) if in_step else 1
    )
    parser.add_argument(
        "--node-rank",
        type=int,
        default=_optional_int(env.get("SLURM_NODEID")) if in_step else None,
        help="this node's index; node 0 hosts the rendezvous (its port is checked)",
    )
    parser.add_argument("--master-addr", default=env.get("MASTER_ADDR"))
    parser.add_argument("--master-port", type=int, default=_optional_int(env.get("MASTER_PORT")))
    parser.add_argument(
        "--rdzv-id",
        default=env.get("SLURM_JOB_ID"),
        help="multi-node: the same on every node, new for each run (names runs/torchrun-<id>)",
    )
    parser.add_argument("--max-restarts", type=int, default=0)
    parser.add_argument(
        "--shutdown-timeout",
        type=int,
        default=120,
        help="seconds the workers get to checkpoint after a stop signal",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the command, run nothing")
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="the trainer's overrides")
    args = parser.parse_args(argv)
    if args.overrides[:1] == ["--"]:
        args.overrides = args.overrides[1:]
    return args


def _optional_int(value: str | None) -> int | None:
    return int(value) if value not in (None, "") else None


def build_command(args: argparse.Namespace) -> list[str]:
    command = [sys.executable, "-m", "torch.distributed.run"]
    command += [f"--nproc-per-node={_nproc(args.nproc_per_node)}"]
    if args.nnodes == 1:
        command += ["--standalone"]
    else:
        command += [
            f"--nnodes={args.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={args.master_addr}:{args.master_port}",
            f"--rdzv-id={args.rdzv_id}",
        ]
        if args.node_rank is not None:  # the host serves the store; the others only connect
            command += [f"--rdzv-conf=is_host={int(args.node_rank == 0)}"]
    command += [f"--max-restarts={args.max_restarts}"]
    options = _torchrun_options()
    if "--signals-to-handle" in options:
        command += [f"--signals-to-handle={SIGNALS}"]
    else:
        os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = SIGNALS
        _warn(
            "this torch's torchrun has no --signals-to-handle: SIGUSR2 may kill torchrun "
            "before the workers save; use SIGTERM as the pre-timeout signal (B:TERM@120)"
        )
    # restarts read the environment variable, not the flag (torch 2.13)
    os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(args.shutdown_timeout)
    if "--shutdown-timeout" in options:
        command += [f"--shutdown-timeout={args.shutdown_timeout}"]
    else:
        _warn(
            "this torch's torchrun has no --shutdown-timeout: workers may get only 30 s to "
            "save after a stop signal"
        )
    return [*command, "-m", "trainer", *args.overrides]


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def _nproc(value: str) -> str:
    if value != "auto":
        return value
    import torch

    return str(torch.cuda.device_count() or 1)


def _world_size(args: argparse.Namespace) -> int | None:
    """Ranks the launch starts, when the command says (torchrun also takes gpu / cpu / xpu)."""
    nproc = _nproc(args.nproc_per_node)
    return args.nnodes * int(nproc) if nproc.isdigit() else None


def _torchrun_options() -> set[str]:
    from torch.distributed.run import get_args_parser

    return {flag for action in get_args_parser()._actions for flag in action.option_strings}


def resolve_rendezvous(args: argparse.Namespace) -> None:
    """Multi-node: check the SLURM step, fill MASTER_ADDR / MASTER_PORT from it when not given."""
    env = os.environ
    if "SLURM_JOB_ID" in env:
        _check_slurm_step(args.nnodes, env)
        if args.nnodes > 1:
            args.master_addr = args.master_addr or first_node(env)
            args.master_port = args.master_port or slurm_port(env["SLURM_JOB_ID"])
    if args.nnodes > 1 and (not args.master_addr or not args.master_port):
        raise LaunchError(
            f"--nnodes={args.nnodes} needs the rendezvous address: pass --master-addr and "
            "--master-port (or export MASTER_ADDR and MASTER_PORT), the same on every node"
        )
    if args.nnodes > 1 and not args.rdzv_id:
        raise LaunchError(
            f"--nnodes={args.nnodes} needs --rdzv-id: the same on every node and new for each "
            "run (it names the run directory runs/torchrun-<id>, which resume=auto continues)"
        )


def _check_slurm_step(nnodes: int, env: Mapping[str, str]) -> None:
    """Inside a SLURM job the launcher runs once per node of its srun step."""
    if "SLURM_STEP_NUM_NODES" not in env:
        if nnodes > 1:
            raise LaunchError(
                f"--nnodes={nnodes} outside an srun step: run the launcher with srun, one task "
                "per node (see launch/slurm/train.sbatch)"
            )
        return
    nodes = int(env["SLURM_STEP_NUM_NODES"])
    tasks = int(env.get("SLURM_STEP_NUM_TASKS") or nodes)
    if nnodes != nodes:
        raise LaunchError(
            f"--nnodes={nnodes} but this srun step runs on {nodes} node(s): submit with "
            "--nodes matching it (the launcher runs once per node)"
        )
    if tasks != nodes:
        raise LaunchError(
            f"this srun step runs {tasks} tasks on {nodes} node(s): run the launcher once per "
            "node (srun --ntasks-per-node=1); torchrun starts each node's processes itself"
        )


def check_port(args: argparse.Namespace) -> None:
    """On the node that hosts the rendezvous, its port must be free."""
    if args.nnodes == 1 or args.node_rank != 0:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # as TCPStore binds: a socket of a just-ended run in TIME_WAIT does not count
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", args.master_port))
        except OSError as err:
            raise LaunchError(
                f"rendezvous port {args.master_port} on {socket.gethostname()} is in use "
                f"({err.strerror}): pick another with --master-port (or MASTER_PORT)"
            ) from None


def check_trainer_settings(overrides: list[str], world_size: int | None) -> None:
    """Compose and validate the trainer's settings here, once, with the start-up rules for
    `world_size` ranks (layout, batch plan, model shape; None: unknown here): a wrong one is one
    line before any worker starts, instead of the same message from every rank and torchrun's
    traceback."""
    trainer_args = hydra_args(overrides)
    if checkable(trainer_args):
        cfg = check_settings(trainer_args.overrides, trainer_args.config_name)
        if world_size is not None:
            from trainer.build import check_start  # the training stack: only for a job

            check_start(cfg, world_size)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        resolve_rendezvous(args)
        check_port(args)
        check_run_dir(args.overrides)
        check_trainer_settings(args.overrides, _world_size(args))
    except (LaunchError, *CONFIG_ERRORS) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    command = build_command(args)
    print("+ " + shlex.join(command), flush=True)
    if args.dry_run:
        return 0
    os.execv(command[0], command)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
