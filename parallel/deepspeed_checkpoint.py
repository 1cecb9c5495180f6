"""DeepSpeed's checkpoint files (`<step dir>/deepspeed/`) outside its engine: how many ranks
wrote them, their conversion to DeepSpeed's universal checkpoint (resharding), and their whole
fp32 weights in one process (export, and starting a run of either engine from them).

DeepSpeed's files are pickles beyond tensors (its config, step counters): like DeepSpeed itself,
this reads them with `weights_only=False`, so load only checkpoints you trust.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from torch import Tensor

from model.errors import ConfigError
from parallel.deepspeed_tables import table_weights

CHECKPOINT_FOLDER = "deepspeed"  # inside the trainer's step directory
MODEL_STATES = "mp_rank_00_model_states.pt"  # ZeRO-0 and 1-2: the module (and 0: optimizer)
LAYOUT = "lmforge_layout.json"  # the run's layout beside DeepSpeed's files (ranks, ep)


def write_layout(folder: Path, ranks: int, ep: int) -> None:
    """What DeepSpeed's files do not say about the run that wrote them (rank 0, after them)."""
    (folder / LAYOUT).write_text(json.dumps({"ranks": ranks, "ep": ep}))


def read_layout(folder: Path) -> dict:
    """write_layout's record ({} for checkpoints written before it existed: ep 1)."""
    path = folder / LAYOUT
    return json.loads(path.read_text()) if path.is_file() else {}


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
    (DeepSpeed's zero_to_fp32; expert_parallel_weights under parallel.ep); ZeRO-0 keeps the
    whole module in one file."""
    folder = step_dir / CHECKPOINT_FOLDER
    layout = read_layout(folder)
    tables = table_weights(folder)  # Engram's, kept out of ZeRO (parallel.deepspeed_tables)
    if layout.get("ep", 1) > 1:
        return expert_parallel_weights(folder, layout["ranks"], layout["ep"]) | tables
    if not saved_ranks(folder):
        state = torch.load(folder / MODEL_STATES, map_location="cpu", weights_only=False)
        return {
            name: t.float() if t.is_floating_point() else t for name, t in state["module"].items()
        } | tables
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError:
        raise ConfigError(
            f'{step_dir} is a DeepSpeed checkpoint; reading it needs DeepSpeed: pip install -e ".[deepspeed]"'
        ) from None

    whole = get_fp32_state_dict_from_zero_checkpoint(str(step_dir), tag=CHECKPOINT_FOLDER)
    return dict(whole) | tables


def expert_parallel_weights(folder: Path, ranks: int, ep: int) -> dict[str, Tensor]:
    """The whole fp32 weights of an expert-parallel ZeRO-1/2 checkpoint (parallel.deepspeed_experts),
    which DeepSpeed's zero_to_fp32 would mix up: a dense optimizer group is partitioned over
    every rank, in rank order; an expert group over the ranks that hold the same experts (those
    of ep rank e: e, e + ep, ...), each list of partitions giving its ep rank's local experts,
    which are concatenated along the expert dimension in ep-rank order."""
    model = torch.load(folder / MODEL_STATES, map_location="cpu", weights_only=False)
    parts = [_fp32_partitions(folder, rank) for rank in range(ranks)]
    counts, paddings = parts[0]["partition_count"], parts[0].get("param_alignment_paddings")
    state = {  # buffers (integer ones keep their dtype: Engram's hash multipliers)
        name: t.float() if t.is_floating_point() else t for name, t in model["module"].items()
    }
    for group, shapes in enumerate(model["param_shapes"]):
        if counts[group] == ranks:
            holders = [list(range(ranks))]
        elif counts[group] * ep == ranks:
            holders = [list(range(e, ranks, ep)) for e in range(ep)]
        else:
            raise ValueError(
                f"{folder}: optimizer group {group} is partitioned over {counts[group]} ranks, "
                f"neither all {ranks} nor the {ranks // ep} of an expert group (ep={ep})"
            )
        pieces = []
        for owners in holders:
            flat = torch.cat([parts[r]["single_partition_of_fp32_groups"][group] for r in owners])
            pieces.append(_unflatten(flat, shapes, paddings[group] if paddings else None))
        for name in shapes:
            state[name] = torch.cat([piece[name] for piece in pieces])
    for alias, source in (model.get("shared_params") or {}).items():  # one tensor, two names
        state[alias] = state[source]
    return state


def _fp32_partitions(folder: Path, rank: int) -> dict:
    """Rank `rank`'s ZeRO-1/2 optimizer file (named `bf16_zero_pp_rank_...` under bf16)."""
    paths = list(folder.glob(f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
    if len(paths) != 1:
        raise FileNotFoundError(f"{folder}: {len(paths)} optimizer files of rank {rank}, not 1")
    return torch.load(paths[0], map_location="cpu", mmap=True, weights_only=False)[
        "optimizer_state_dict"
    ]


def _unflatten(flat: Tensor, shapes: dict, paddings: list[int] | None) -> dict[str, Tensor]:
    """A ZeRO group's flat fp32 vector cut into its parameters (each followed by its alignment
    padding, where DeepSpeed recorded one)."""
    out, offset = {}, 0
    for index, (name, shape) in enumerate(shapes.items()):
        numel = math.prod(shape)
        out[name] = flat.narrow(0, offset, numel).view(shape).clone()
        offset += numel + (paddings[index] if paddings else 0)
    return out
