"""Loading a DeepSpeed checkpoint on another number of ranks or another ZeRO stage (1-3):
DeepSpeed's universal checkpoint.

Rank 0 runs DeepSpeed's converter (`ds_to_universal --inject_missing_state`, a child process)
from the ZeRO partitions of N ranks into one folder per parameter (fp32 weights, Adam moments,
step); every rank then loads its own partitions from it, whatever its stage. The other ranks wait for the
conversion on a status file rather than in a collective, whose timeout (parallel.timeout_s) a
large model's conversion would outlast. Two DeepSpeed 0.19.8 bugs in ZeRO-3's universal load are
undone after it (see load_universal).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
import uuid
from contextlib import suppress
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from parallel.collective import from_main
from parallel.deepspeed.checkpoint import MODEL_STATES
from parallel.deepspeed.safe_load import load_file, vet_folder

log = logging.getLogger("parallel.deepspeed")
POLL_S = 1.0
WAIT_S = 6 * 3600.0  # the longest conversion waited for (then the broadcast's timeout)


def convert_on_main(folder: Path, out: Path, what: str, zero3: bool) -> str | None:
    """Rank 0 converts `folder` (`what`: from which ZeRO stage and rank count to which) into
    `out`; every rank returns None when it worked, else rank 0's reason, and then nothing of the
    conversion is left (`out.parent`, and its parent once empty). The other ranks wait on rank
    0's "done" file (the checkpoint's filesystem is shared, as for every checkpoint) and then
    take the outcome from it by broadcast."""
    done = out.parent.parent / f".{out.parent.name}.{from_main(uuid.uuid4().hex)}.done"
    outcome = ""
    if dist.get_rank() == 0:
        log.info(
            "%s: converting it to DeepSpeed's universal checkpoint (%s) in %s",
            folder.parent, what, out.parent,
        )  # fmt: skip
        try:
            convert_to_universal(folder, out, zero3)
        except (OSError, RuntimeError) as err:
            outcome = f"{folder.parent} could not be converted ({what}): {err}"
        except BaseException:  # Ctrl-C: nothing of the conversion stays behind
            remove_conversion(out.parent)
            raise
        finally:
            try:
                done.parent.mkdir(parents=True, exist_ok=True)
                done.touch()
            except OSError as err:  # the others then wait out their deadline
                outcome = outcome or f"{done.parent} is not writable: {err}"
    else:
        deadline = time.monotonic() + WAIT_S
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(POLL_S)
    outcome = from_main(outcome)  # rank 0's word, whatever each rank saw
    if dist.get_rank() == 0:
        done.unlink(missing_ok=True)
        if outcome:
            remove_conversion(out.parent)
    return outcome or None


def remove_conversion(universal: Path) -> None:
    """Delete a conversion's folder, and the scratch folder holding it once that is empty."""
    shutil.rmtree(universal, ignore_errors=True)
    with suppress(OSError):
        universal.parent.rmdir()


def convert_to_universal(folder: Path, out: Path, zero3: bool) -> None:
    """DeepSpeed's own converter (`python -m deepspeed.checkpoint.ds_to_universal`) in a child
    process: ZeRO partitions of any number of ranks -> one folder per parameter with its fp32
    weights and optimizer states, which any number of ranks and any ZeRO stage 1-3 (`zero3`: the
    loading run's) can load. The converter reads the files with DeepSpeed's full unpickler: they
    are vetted first."""
    vet_folder(folder)
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
    adapt_to_stage(out, zero3)


ZERO3_MODEL_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"


def adapt_to_stage(universal: Path, zero3: bool) -> None:
    """Make a conversion of one ZeRO stage's files loadable by the other kind (`zero3`: the
    loading run's). DeepSpeed 0.19's converter writes a ZeRO-1/2 source and a ZeRO-3 source in
    two forms, and each stage's universal load reads only its own:

        module file    the source's, whose name tells the stage (the load reads only metadata
                       from it: the weights come from the per-parameter folders): copied to the
                       other name
        zero/optimizer_state.pt
                       ZeRO-3 reads its step and groups from a nested optimizer state, ZeRO-1/2
                       needs the DeepSpeed version beside its groups: each added from the other
        zero/<param>/  ZeRO-1/2 reads {"param": weight-shaped tensor, "cat_dim": 0} files and a
                       step.pt; ZeRO-3 writes flat tensors and no step: rewritten
    """
    source, target = (
        (MODEL_STATES, ZERO3_MODEL_STATES) if zero3 else (ZERO3_MODEL_STATES, MODEL_STATES)
    )
    if (universal / source).is_file() and not (universal / target).is_file():
        shutil.copyfile(universal / source, universal / target)
    states = universal / "zero" / "optimizer_state.pt"
    if not states.is_file():
        return
    optimizer = load_file(states)
    if zero3 and "optimizer_state_dict" not in optimizer:
        steps = sorted((universal / "zero").glob("*/step.pt"))
        step = load_file(steps[0]) if steps else torch.zeros(())
        groups = optimizer["param_groups"]
        optimizer["optimizer_state_dict"] = {"state": {0: {"step": step}}, "param_groups": groups}
        torch.save(optimizer, states)
    elif not zero3 and "ds_version" not in optimizer:
        module = load_file(universal / MODEL_STATES)
        optimizer["ds_version"] = module["ds_version"]
        torch.save(optimizer, states)
        step = optimizer["optimizer_state_dict"]["state"][0]["step"]
        _shaped_parameter_files(universal / "zero", module["param_shapes"], step)


def _shaped_parameter_files(zero: Path, param_shapes: list[dict], step: Tensor) -> None:
    """ZeRO-3's flat per-parameter tensors -> ZeRO-1/2's shaped ones, each folder with a step."""
    shapes = {name: shape for group in param_shapes for name, shape in group.items()}
    for name, shape in shapes.items():
        folder = zero / name
        for path in folder.glob("*.pt"):
            value = load_file(path)
            if isinstance(value, Tensor):
                torch.save({"param": value.view(shape), "cat_dim": 0}, path)
        if folder.is_dir() and not (folder / "step.pt").is_file():
            torch.save(step, folder / "step.pt")


def load_universal(engine: Any, universal: Path, tag: str) -> None:
    """DeepSpeed's universal load of `universal/<tag>` into `engine`, with the run's own group
    hyperparameters kept and each partition's Adam step counter its own."""
    # ZeRO-3's universal load gives every group the first group's hyperparameters (weight decay
    # included) (DeepSpeed 0.19.8: stage3.py::load_hp_checkpoint_state_from_checkpoint_dir_stage3)
    settings = [
        {k: v for k, v in group.items() if k not in ("params", "step")}
        for group in engine.optimizer.param_groups
    ]
    engine._config.load_universal_checkpoint = True  # read once, at load time
    try:
        path, _ = engine.load_checkpoint(str(universal), tag=tag, load_lr_scheduler_states=False)
    finally:
        engine._config.load_universal_checkpoint = False
    if path is None:
        raise FileNotFoundError(f"DeepSpeed found no universal checkpoint in {universal}")
    for group, own in zip(engine.optimizer.param_groups, settings, strict=True):
        group.update(own)
    _unshare_step_counters(engine.optimizer)


def _unshare_step_counters(zero_optimizer: Any) -> None:
    """ZeRO-3's universal load gives every partition's state the same `step` tensor, which
    torch's Adam then advances once per partition and step (Adam's bias correction runs
    ahead): each state gets its own copy."""
    inner = getattr(zero_optimizer, "optimizer", None)
    seen: set[int] = set()
    for state in getattr(inner, "state", {}).values():
        step = state.get("step")
        if isinstance(step, Tensor):
            if id(step) in seen:
                state["step"] = step.clone()
            seen.add(id(step))
