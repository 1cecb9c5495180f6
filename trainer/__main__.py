"""`python -m trainer [overrides]`: train (the same command under torchrun or srun).

Hydra composes `conf/config.yaml` with the overrides, typed by trainer.config.RootConfig, so a
misspelled key or a wrong type stops here before anything starts. Errors in the values (a rule
of a config dataclass, a dataset problem) end the run with their message and exit code 2
(settings) or 1 (data, checkpoints), without a traceback; a run directory that this launch
created is removed again after a settings error.

Before Hydra runs, the run directory is chosen (unique per launch) and locked by rank 0, so a
second trainer on it stops before writing anything (trainer.run_dir).
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from data.atomic import is_disk_full
from data.errors import DataError
from model.errors import ConfigError
from optim.errors import OptimConfigError
from trainer import run_dir as run_dirs
from trainer.checkpoint import CheckpointError
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

register_configs()
register_resolvers()
SETTINGS_ERRORS = (ConfigError, OptimConfigError)
EXPECTED_ERRORS = (ConfigError, DataError, OptimConfigError, CheckpointError)


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(dict_cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        cfg = OmegaConf.to_object(dict_cfg)
        ranks = ranks_from_env()
        if ranks.is_main:
            run_dirs.lock(run_dir)  # a no-op when the entry point already holds it
        device = pick_device(cfg.trainer.device, ranks.local_rank)
        init_distributed(ranks, cfg.parallel.backend, device, cfg.parallel.timeout_s)
    except (ConfigError, DataError, OptimConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
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


def _finish(code: int, run_dir: Path) -> None:
    """Exit with `code`; in a sweep (`-m`, also on SLURM through submitit) the other jobs go on,
    so a job reports its failure by raising instead. A settings error removes the run directory
    this launch created; a sweep job releases its lock."""
    if code == 2 and ranks_from_env().is_main and run_dirs.remove_if_created(run_dir):
        print(f"removed the run directory {run_dir} that this launch had created", file=sys.stderr)
    if HydraConfig.get().mode != RunMode.MULTIRUN:
        sys.exit(code)
    run_dirs.release(run_dir)
    if code != 0:
        raise RuntimeError(f"training ended with exit code {code}: see the job's train.log")


def choose_run_dir(argv: list[str], ranks: Ranks) -> None:
    """Before Hydra: check (and for rank 0, create and lock) the run directory; without
    `hydra.run.dir`, pick a unique default and pass it to Hydra as that override."""
    explicit = run_dirs.explicit_run_dir(argv[1:])
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


if __name__ == "__main__":
    try:  # before Hydra: the run directory and `.hydra/` depend on the rank
        launch_ranks = ranks_from_env()
        if "-m" not in sys.argv[1:] and "--multirun" not in sys.argv[1:]:
            choose_run_dir(sys.argv, launch_ranks)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    main()
