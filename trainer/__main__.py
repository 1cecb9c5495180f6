"""`python -m trainer [overrides]`: train (the same command under torchrun or srun).

Hydra composes `conf/config.yaml` with the overrides, typed by trainer.config.RootConfig, so a
misspelled key or a wrong type stops here before anything starts. Errors in the values (a rule
of a config dataclass, a dataset problem) end the run with their message and exit code 2 or 1,
without a traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from data.errors import DataError
from model.errors import ConfigError
from optim.errors import OptimConfigError
from trainer.checkpoint import CheckpointError
from trainer.cluster_env import check_run_dir
from trainer.config import CONF_DIR, register_configs
from trainer.distributed import agree_on_run_dir, init_distributed, shutdown_distributed
from trainer.runtime import pick_device, ranks_from_env, register_resolvers, setup_logging

register_configs()
register_resolvers()


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(dict_cfg: DictConfig) -> None:
    try:
        cfg = OmegaConf.to_object(dict_cfg)
        ranks = ranks_from_env()
        init_distributed(
            ranks, cfg.parallel.backend, pick_device(cfg.trainer.device, ranks.local_rank)
        )
    except (ConfigError, DataError, OptimConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        _finish(2)
        return
    run_dir = agree_on_run_dir(Path(HydraConfig.get().runtime.output_dir), ranks)
    setup_logging(run_dir, ranks)
    import logging

    from trainer.app import train

    log = logging.getLogger("trainer")
    log.info("run directory: %s", run_dir)
    try:
        code = train(cfg, run_dir, ranks)
    except (ConfigError, DataError, OptimConfigError, CheckpointError) as err:
        log.error("%s", err)
        code = 1
    if code == 0:
        shutdown_distributed()
    _finish(code)


def _finish(code: int) -> None:
    """Exit with `code`; in a sweep (`-m`, also on SLURM through submitit) the other jobs go on,
    so a job reports its failure by raising instead."""
    if HydraConfig.get().mode != RunMode.MULTIRUN:
        sys.exit(code)
    if code != 0:
        raise RuntimeError(f"training ended with exit code {code}: see the job's train.log")


if __name__ == "__main__":
    try:  # before Hydra: the run directory and `.hydra/` depend on the rank
        ranks_from_env()
        if "-m" not in sys.argv[1:] and "--multirun" not in sys.argv[1:]:
            check_run_dir(sys.argv[1:])
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    main()
