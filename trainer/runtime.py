"""Process-level setup: ranks from the environment, the shared run directory, logging, device,
seeds and threads.

Under torchrun or srun every rank composes the config itself, so anything that names the run
directory must come out the same on all ranks: the SLURM job id or torchrun's run id when there
is one, else a timestamp (single process). Only rank 0 writes `.hydra/` and logs to the console;
it also writes `train.log`, and every other rank writes `logs/rank<N>.log`.
"""

from __future__ import annotations

import logging
import os
import random
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf
from rich.logging import RichHandler

from trainer.cluster_env import check_ranks, map_srun_env
from trainer.console import console

log = logging.getLogger("trainer")


@dataclass(frozen=True)
class Ranks:
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def ranks_from_env() -> Ranks:
    """This process's place in the launch (torchrun's or mapped srun variables), checked."""
    map_srun_env(os.environ)
    rank, world_size, local_rank = check_ranks(os.environ)
    return Ranks(rank=rank, world_size=world_size, local_rank=local_rank)


def default_run_dir() -> str:
    """runs/<id> that every rank of one launch computes identically."""
    return launch_run_dir() or f"runs/{datetime.now():%Y-%m-%d_%H-%M-%S}"


def launch_run_dir() -> str | None:
    """runs/slurm-<job id> or runs/torchrun-<run id>: the launch's own id names it (the same
    directory after a requeue or an elastic restart); None for a plain single process."""
    env = os.environ
    if env.get("SLURM_JOB_ID"):
        return f"runs/slurm-{env['SLURM_JOB_ID']}"
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none" and int(env.get("WORLD_SIZE", 1)) > 1:
        return f"runs/torchrun-{run_id}"
    return None


def register_resolvers() -> None:
    """`${lmforge_run_dir:}` and `${lmforge_rank_zero:x}` (x on rank 0, null elsewhere)."""
    if not OmegaConf.has_resolver("lmforge_run_dir"):
        OmegaConf.register_new_resolver("lmforge_run_dir", default_run_dir)
    if not OmegaConf.has_resolver("lmforge_rank_zero"):
        OmegaConf.register_new_resolver(
            "lmforge_rank_zero", lambda x: x if ranks_from_env().is_main else None
        )


def setup_logging(run_dir: Path, ranks: Ranks) -> None:
    fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    if ranks.is_main:
        path = run_dir / "train.log"
        if console.is_terminal:  # rich on a terminal; plain lines into pipes and job logs
            screen: logging.Handler = RichHandler(console=console, show_path=False, markup=False)
            screen.setFormatter(logging.Formatter("%(message)s"))
        else:
            screen = logging.StreamHandler(sys.stderr)
            screen.setFormatter(logging.Formatter(fmt, "%H:%M:%S"))
        handlers: list[logging.Handler] = [screen]
    else:
        path = run_dir / "logs" / f"rank{ranks.rank}.log"
        handlers = []
    path.parent.mkdir(parents=True, exist_ok=True)
    to_file = logging.FileHandler(path)
    to_file.setFormatter(logging.Formatter(fmt, "%Y-%m-%d %H:%M:%S"))
    handlers.append(to_file)
    root = logging.getLogger()
    root.handlers[:] = handlers
    root.setLevel(logging.INFO)
    for noisy in ("matplotlib", "PIL", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.captureWarnings(True)


def pick_device(choice: str, local_rank: int) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            from model.errors import ConfigError

            raise ConfigError("trainer.device=cuda but torch sees no CUDA device")
        # modulo: a task bound to its own GPU (srun --gpus-per-task=1) sees one device
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """Every RNG stream as tensors and plain values (checkpoints load with weights_only=True)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():  # this rank's device only (visibility may differ on resume)
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(_tuples(state["python"]))
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        torch.cuda.set_rng_state(
            cuda[torch.cuda.current_device()] if isinstance(cuda, list) else cuda
        )


def _tuples(value):
    """random.setstate wants the nested tuples that random.getstate gave."""
    return tuple(_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value


def describe_environment() -> str:
    return (
        f"python {sys.version.split()[0]}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
