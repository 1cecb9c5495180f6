"""`python -m trainer [overrides]`: train (the same command under torchrun or srun).

Before Hydra runs, the settings are composed and validated once (trainer.settings: a wrong
type, an unknown key or preset, a rule of a config dataclass) and any problem ends in one line
and exit code 2, printed by rank 0 only, before any file exists. Then the run directory is
chosen (unique per launch) and locked by rank 0, so a second trainer on it stops before writing
anything (trainer.run_dir). Commands that only print (`--help`, `--cfg`, `--info`, ...) and
sweeps (`-m`) go straight to Hydra.

Hydra then composes `conf/config.yaml` with the overrides, typed by trainer.config.RootConfig.
Errors found later (rules across groups, a dataset problem, a checkpoint that does not fit) end
the run with their message and exit code 2 (settings) or 1 (data, checkpoints), without a
traceback; a run directory that this launch created and that holds only what start-up wrote is
removed again.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from data.atomic import is_disk_full
from data.errors import DataError
from model.errors import ConfigError
from optim.errors import OptimConfigError
from trainer import run_dir as run_dirs
from trainer.checkpoint.errors import CheckpointError
from trainer.config import CONF_DIR, register_configs
from trainer.distributed import agree_on_run_dir, init_distributed, shutdown_distributed
from trainer.runtime import (
    Ranks,
    default_run_dir,
    launch_run_dir,
    pick_device,
    ranks_from_env,
    register_resolvers,
    setup_logging,
)
from trainer.settings import (
    CONFIG_ERRORS,
    check_settings,
    checkable,
    hydra_args,
    is_sweep,
    runs_a_job,
)

register_configs()
register_resolvers()
SETTINGS_ERRORS = (ConfigError, OptimConfigError)
EXPECTED_ERRORS = (ConfigError, DataError, OptimConfigError, CheckpointError)
QUIET_RANK_WAIT_S = 10.0  # see _refuse


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(dict_cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    ranks = None
    try:
        cfg = OmegaConf.to_object(dict_cfg)
        ranks = ranks_from_env()
        if ranks.is_main:
            run_dirs.lock(run_dir)  # a no-op when the entry point already holds it
        device = pick_device(cfg.trainer.device, ranks.local_rank)
        init_distributed(ranks, cfg.parallel.backend, device, cfg.parallel.timeout_s)
    except CONFIG_ERRORS as err:
        if ranks is None or ranks.is_main:  # the other ranks' copies of the line add nothing
            print(f"error: {err}", file=sys.stderr)
        if ranks is not None:
            _discard(run_dir, ranks)
        _finish(2, run_dir)
        return
    except KeyboardInterrupt:
        _finish(_interrupted(), run_dir)
        return
    run_dir = agree_on_run_dir(run_dir, ranks)
    setup_logging(run_dir, ranks)
    _finish(_train(cfg, run_dir, ranks), run_dir)


def _train(cfg, run_dir: Path, ranks: Ranks) -> int:
    import logging

    from trainer.app import train

    log = logging.getLogger("trainer")
    log.info("run directory: %s", run_dir)
    try:
        code = train(cfg, run_dir, ranks)
    except EXPECTED_ERRORS as err:
        log.error("%s", err)
        _discard(run_dir, ranks)  # a start-up refusal (settings, data) leaves no run directory
        code = 2 if isinstance(err, SETTINGS_ERRORS) else getattr(err, "exit_code", 1)
    except KeyboardInterrupt:
        return _interrupted()
    except OSError as err:
        if not is_disk_full(err):
            raise
        log.error(
            "no space left on the device of %s: %s; free space and run the same command "
            "again (resume=auto continues from the newest checkpoint)",
            err.filename or run_dir,
            err.strerror,
        )
        return 1
    if code in (0, 130):  # every rank stopped at the same step: they can meet once more
        shutdown_distributed()
    return code


def _interrupted() -> int:
    print("interrupted before training started: nothing to save yet", file=sys.stderr)
    return 130


def _discard(run_dir: Path, ranks: Ranks) -> None:
    """After an error the user can fix: remove the run directory if this launch created it and
    it holds only what start-up writes (trainer.run_dir.remove_if_unused)."""
    if ranks.is_main and run_dirs.remove_if_unused(run_dir):
        print(f"removed the run directory {run_dir} that this launch had created", file=sys.stderr)


def _finish(code: int, run_dir: Path) -> None:
    """Exit with `code`; in a sweep (`-m`, also on SLURM through submitit) the other jobs go on,
    so a job reports its failure by raising instead, and releases its lock."""
    if HydraConfig.get().mode != RunMode.MULTIRUN:
        sys.exit(code)
    run_dirs.release(run_dir)
    if code != 0:
        raise RuntimeError(f"training ended with exit code {code}: see the job's train.log")


def choose_run_dir(overrides: list[str], argv: list[str], ranks: Ranks) -> None:
    """Before Hydra: check (and for rank 0, create and lock) the run directory; without
    `hydra.run.dir`, pick a unique default and pass it to Hydra as that override."""
    explicit = run_dirs.explicit_run_dir(overrides)
    if explicit is not None and "${" in explicit:
        return  # an interpolation: only Hydra can resolve it (main() locks it then)
    run_dir = Path(explicit or default_run_dir())
    run_dirs.check_writable(run_dir)
    if explicit is None:
        if ranks.world_size == 1 and launch_run_dir() is None:
            run_dir = run_dirs.claim_unique(run_dir)  # two runs in the same second differ
        argv.append(f"hydra.run.dir={run_dir}")
    if ranks.is_main:
        run_dirs.lock(run_dir)


def before_hydra(argv: list[str]) -> None:
    """Check the settings, then choose the run directory: a wrong setting stops (exit 2, one
    line from rank 0) before anything exists. Commands that print only and sweeps skip both."""
    args = hydra_args(argv[1:])  # as hydra.main parses them (--version prints and exits here)
    if not runs_a_job(args) or is_sweep(args):
        return
    try:
        ranks = ranks_from_env()
    except ConfigError as err:
        _refuse(err, loud=True)
    try:
        if checkable(args):
            check_settings(args.overrides, args.config_name)
    except CONFIG_ERRORS as err:
        _refuse(err, loud=ranks.is_main)  # every rank finds the same: rank 0 says it
    try:
        choose_run_dir(args.overrides, argv, ranks)
    except ConfigError as err:  # this node's file system: every rank says it
        _refuse(err, loud=True)


def _refuse(err: Exception, loud: bool) -> NoReturn:
    """Exit 2, saying why; a quiet rank (not rank 0, which says it) first gives rank 0 time to:
    torchrun stops every worker once one exits, and would stop rank 0 before its line."""
    if loud:
        print(f"error: {err}", file=sys.stderr)
    else:
        time.sleep(QUIET_RANK_WAIT_S)  # torchrun ends this wait when rank 0 exits
    sys.exit(2)


if __name__ == "__main__":
    before_hydra(sys.argv)
    main()
