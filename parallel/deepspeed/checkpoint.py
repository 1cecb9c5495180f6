"""DeepSpeed's checkpoint files (`<step dir>/deepspeed/`) outside its engine: which ZeRO stage
and how many ranks wrote them, whether all their files are there, and their whole fp32 weights
in one process (export, and starting a run of either engine from them).

DeepSpeed's files are pickles beyond tensors (its config, step counters, a few classes of its
own): they are read with torch's weights-only unpickler and those classes allowed
(parallel.deepspeed.safe_load), never with DeepSpeed's full one before they were vetted.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import Tensor

from model.errors import ConfigError
from parallel.deepspeed.safe_load import load_file, vet_folder
from parallel.deepspeed.tables import table_weights

CHECKPOINT_FOLDER = "deepspeed"  # inside the trainer's step directory
MODEL_STATES = "mp_rank_00_model_states.pt"  # ZeRO-0 and 1-2: the module (and 0: optimizer)
LAYOUT = "lmforge_layout.json"  # the run's layout beside DeepSpeed's files (ranks, ep)


def write_layout(folder: Path, ranks: int, ep: int, zero_stage: int) -> None:
    """What DeepSpeed's files do not say about the run that wrote them (rank 0, after them)."""
    (folder / LAYOUT).write_text(json.dumps({"ranks": ranks, "ep": ep, "zero_stage": zero_stage}))


def read_layout(folder: Path) -> dict:
    """write_layout's record ({} for checkpoints written before it existed: ep 1)."""
    path = folder / LAYOUT
    return json.loads(path.read_text()) if path.is_file() else {}


def saved_stage(folder: Path) -> int:
    """The ZeRO stage that wrote `folder`: recorded, or (older checkpoints) told by the files:
    ZeRO-3 partitions the module too (a model file per rank), ZeRO-1/2 only the optimizer
    (same files for both: 1 and 2 load each other's), ZeRO-0 partitions nothing."""
    recorded = read_layout(folder).get("zero_stage")
    if recorded is not None:
        return int(recorded)
    if any(folder.glob("*zero_pp_rank_*_model_states.pt")):
        return 3
    return 2 if any(folder.glob("*zero_pp_rank_*_optim_states.pt")) else 0


def saved_ranks(folder: Path) -> int:
    """How many ranks wrote a DeepSpeed checkpoint folder (0: not partitioned, ZeRO-0)."""
    return len(list(folder.glob("*zero_pp_rank_*_optim_states.pt"))) or len(
        list(folder.glob("*zero_pp_rank_*_model_states.pt"))
    )


def check_partitions(folder: Path) -> int:
    """saved_ranks(folder), once every file of every rank that wrote it is there (the layout
    record says how many did; older checkpoints: the rank numbers must run 0..N-1). A missing
    file is damage (FileNotFoundError), never a checkpoint of fewer ranks."""
    stage, found = saved_stage(folder), saved_ranks(folder)
    ranks = read_layout(folder).get("ranks", found) if stage else 0
    kinds = ["optim", "model"] if stage == 3 else ["optim"] if stage else []
    missing = [] if stage == 3 or (folder / MODEL_STATES).is_file() else [MODEL_STATES]
    for kind in kinds:
        for rank in range(ranks):
            if not any(folder.glob(f"*zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt")):
                missing.append(f"rank {rank}'s {kind} states")
    if missing or found != ranks:
        what = ", ".join(missing) or f"{found} ranks' partitions"
        raise FileNotFoundError(f"{folder} lacks {what} ({ranks} ranks wrote it)")
    return ranks


def consolidated_weights(step_dir: Path) -> dict[str, Tensor]:
    """The whole fp32 state dict (parameters and persistent buffers) of the DeepSpeed
    checkpoint in `step_dir`, gathered from every rank's ZeRO partitions in this process
    (DeepSpeed's zero_to_fp32; expert_parallel_weights under parallel.ep); ZeRO-0 keeps the
    whole module in one file."""
    folder = step_dir / CHECKPOINT_FOLDER
    layout = read_layout(folder)
    tables = table_weights(folder)  # Engram's, kept out of ZeRO (parallel.deepspeed.tables)
    if layout.get("ep", 1) > 1:
        return expert_parallel_weights(folder, layout["ranks"], layout["ep"]) | tables
    if not saved_ranks(folder):
        state = load_file(folder / MODEL_STATES)
        return {
            name: t.float() if t.is_floating_point() else t for name, t in state["module"].items()
        } | tables
    try:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    except ImportError:
        raise ConfigError(
            f'{step_dir} is a DeepSpeed checkpoint; reading it needs DeepSpeed: pip install -e ".[deepspeed]"'
        ) from None

    vet_folder(folder)  # zero_to_fp32 reads them with DeepSpeed's full unpickler
    whole = get_fp32_state_dict_from_zero_checkpoint(str(step_dir), tag=CHECKPOINT_FOLDER)
    return dict(whole) | tables


def expert_parallel_weights(folder: Path, ranks: int, ep: int) -> dict[str, Tensor]:
    """The whole fp32 weights of an expert-parallel ZeRO-1/2 checkpoint (parallel.deepspeed.experts),
    which DeepSpeed's zero_to_fp32 would mix up: a dense optimizer group is partitioned over
    every rank, in rank order; an expert group over the ranks that hold the same experts (those
    of ep rank e: e, e + ep, ...), each list of partitions giving its ep rank's local experts,
    which are concatenated along the expert dimension in ep-rank order."""
    model = load_file(folder / MODEL_STATES)
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
    return load_file(paths[0], mmap=True)["optimizer_state_dict"]


def _unflatten(flat: Tensor, shapes: dict, paddings: list[int] | None) -> dict[str, Tensor]:
    """A ZeRO group's flat fp32 vector cut into its parameters (each followed by its alignment
    padding, where DeepSpeed recorded one)."""
    out, offset = {}, 0
    for index, (name, shape) in enumerate(shapes.items()):
        numel = math.prod(shape)
        out[name] = flat.narrow(0, offset, numel).view(shape).clone()
        offset += numel + (paddings[index] if paddings else 0)
    return out
