"""Reading DeepSpeed's checkpoint files without running code from them.

DeepSpeed writes its files with `torch.save` (pickles of tensors, its config values and a few
of its own classes) and reads them back with `weights_only=False`, so a crafted file would run
whatever it asks for on resume or export. Here every `.pt` file of a DeepSpeed checkpoint goes
through torch's weights-only unpickler, with exactly the classes DeepSpeed stores allowed
(`deepspeed_globals`):

- `vet_folder` reads each file once (memory-mapped: the pickle is parsed, tensor data is not
  read) before anything else opens it: DeepSpeed's converter and zero_to_fp32 read them again
  with their own (full) unpickler;
- `load_file` is the reading that lmforge's own code and DeepSpeed's engine load use
  (`guard_engine` puts it in place of the engine's checkpoint reader).

A refused file raises `UnsafeFileError` naming the file and the class it asked for.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch


class UnsafeFileError(ValueError):
    """A checkpoint file asked to build something that is not plain checkpoint data."""


def deepspeed_globals() -> list[Any]:
    """The classes DeepSpeed 0.19's checkpoint files hold (its loss scaler, ZeRO stage enum and
    the addresses of ZeRO's fp32 fragments); [] without DeepSpeed, whose files then cannot
    hold them anyway."""
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
    except ImportError:
        return []
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def load_file(path: str | Path, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """`torch.load` of a DeepSpeed checkpoint file with the weights-only unpickler."""
    try:
        with torch.serialization.safe_globals(deepspeed_globals()):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        raise UnsafeFileError(
            f"{path} refused: {unpickling_problem(err)} (a crafted file?)"
        ) from None


def vet_folder(folder: Path, rank: int = 0, size: int = 1) -> None:
    """Refuse (UnsafeFileError) a checkpoint folder with a file that is more than plain data;
    rank `rank` of `size` checks every size-th file (the callers agree on the outcome)."""
    for path in sorted(folder.glob("*.pt"))[rank::size]:
        load_file(path, mmap=True)


def guard_engine(ds_engine: Any) -> None:
    """Make `ds_engine`'s own checkpoint loads (module, optimizer partitions, experts) use
    load_file instead of its full unpickler."""
    ds_engine.checkpoint_engine.load = lambda path, map_location=None: load_file(
        path, map_location=map_location
    )


def unpickling_problem(err: BaseException) -> str:
    """The informative line of torch's weights-only error (it names the refused global)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    named = [line for line in lines if "Unsupported global" in line or "GLOBAL" in line]
    return (named or lines or [type(err).__name__])[0]
