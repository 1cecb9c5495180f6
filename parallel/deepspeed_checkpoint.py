"""DeepSpeed's checkpoint files (`<step dir>/deepspeed/`) outside its engine: how many ranks
wrote them, their conversion to DeepSpeed's universal checkpoint (resharding), and their whole
fp32 weights in one process (export, and starting a run of either engine from them).

DeepSpeed's files are pickles beyond tensors (its config, step counters): like DeepSpeed itself,
this reads them with `weights_only=False`, so load only checkpoints you trust.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from torch import Tensor

from model.errors import ConfigError

CHECKPOINT_FOLDER = "deepspeed"  # inside the trainer's step directory
MODEL_STATES = "mp_rank_00_model_states.pt"  # ZeRO-0 and 1-2: the module (and 0: optimizer)


def convert_to_universal(folder: Path, out: Path) -> None:
    """DeepSpeed's own converter (`python -m deepspeed.checkpoint.ds_to_universal`) in a child
    process: ZeRO partitions of any number of ranks -> one folder per parameter with its fp32
    weights and optimizer states, which any number of ranks can load."""
    shutil.rmtree(out.parent, ignore_errors=True)  # a conversion an earlier crash left
    out.parent.mkdir(parents=True)
    workers = max(1, min(8, (os.cpu_count() or 1) // 2))
    command = [
        sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
        "--input_folder", str(folder), "--output_folder", str(out), "--inject_missing_state",
        "--num_extract_workers", str(workers), "--num_merge_workers", str(max(1, workers // 2)),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(
            f"DeepSpeed could not convert {folder} to a universal checkpoint: {tail[0]}"
        )


def saved_ranks(folder: Path) -> int:
    """How many ranks wrote a DeepSpeed checkpoint folder (0: not partitioned, ZeRO-0)."""
    return len(list(folder.glob("*zero_pp_rank_*_optim_states.pt"))) or len(
        list(folder.glob("*zero_pp_rank_*_model_states.pt"))
    )


def consolidated_weights(step_dir: Path) -> dict[str, Tensor]:
    """The whole fp32 state dict (parameters and persistent buffers) of the DeepSpeed
    checkpoint in `step_dir`, gathered from every rank's ZeRO partitions in this process
    (DeepSpeed's zero_to_fp32); ZeRO-0 keeps the whole module in one file."""
    folder = step_dir / CHECKPOINT_FOLDER
    if not saved_ranks(folder):
        state = torch.load(folder / MODEL_STATES, map_location="cpu", weights_only=False)
        return {
            name: t.float() if t.is_floating_point() else t for name, t in state["module"].items()
        }
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError:
        raise ConfigError(
            f'{step_dir} is a DeepSpeed checkpoint; reading it needs DeepSpeed: pip install -e ".[deepspeed]"'
        ) from None

    return dict(get_fp32_state_dict_from_zero_checkpoint(str(step_dir), tag=CHECKPOINT_FOLDER))
