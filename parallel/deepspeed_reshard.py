"""Loading a DeepSpeed checkpoint on another number of ranks: DeepSpeed's universal checkpoint.

Rank 0 runs DeepSpeed's converter (`ds_to_universal --inject_missing_state`, a child process)
from the ZeRO partitions of N ranks into one folder per parameter (fp32 weights, Adam moments,
step); every rank then loads its own partitions from it. The other ranks wait for the
conversion on a status file rather than in a collective, whose timeout (parallel.timeout_s) a
large model's conversion would outlast. Two DeepSpeed 0.19.8 bugs in ZeRO-3's universal load are
undone after it (see load_universal).
"""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import Tensor

from parallel.collective import from_main
from parallel.deepspeed_checkpoint import convert_to_universal

log = logging.getLogger("parallel.deepspeed")
POLL_S = 1.0
WAIT_S = 6 * 3600.0  # the longest conversion waited for (then the broadcast's timeout)


def convert_on_main(folder: Path, out: Path, written: int, size: int) -> str | None:
    """Rank 0 converts `folder` (ZeRO partitions of `written` ranks) into `out`; every rank
    returns None when it worked, else rank 0's reason. The other ranks wait on rank 0's "done"
    file (the checkpoint's filesystem is shared, as for every checkpoint) and then take the
    outcome from it by broadcast."""
    done = out.parent.parent / f".{out.parent.name}.{from_main(uuid.uuid4().hex)}.done"
    outcome = ""
    if dist.get_rank() == 0:
        log.info(
            "%s was written by %d ranks; converting it to DeepSpeed's universal checkpoint for "
            "%d in %s", folder.parent, written, size, out.parent,
        )  # fmt: skip
        try:
            convert_to_universal(folder, out)
        except (OSError, RuntimeError) as err:
            outcome = f"{folder.parent} could not be converted for {size} ranks: {err}"
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
    return outcome or None


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
