"""Reading checkpoints without running code from them.

A checkpoint directory may come from anywhere (a shared file system, a download), and pickle
runs whatever a file asks it to. So:
- `trainer_rank<R>.pt` holds only tensors and plain Python values and is read with
  `torch.load(weights_only=True)`;
- DCP's `.metadata` is a pickle of DCP's own metadata classes: `SafeReader` unpickles it with a
  whitelist of exactly those classes (and torch.Size, dtypes, paths);
- DCP's non-tensor items (optimizer hyperparameters, steps) go through `weights_only=True` too
  (`SafePlanner`), where DCP itself would use a full unpickler.
Anything else is refused with `UnsafeCheckpointError`, naming the file and the class it wanted.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta

from parallel.deepspeed.safe_load import unpickling_problem
from trainer.checkpoint.errors import UnsafeCheckpointError

METADATA = ".metadata"
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


def _metadata_class(module: str, name: str) -> bool:
    """A class (dataclass or enum) defined in DCP's metadata module itself (not one it imports)."""
    if module != dcp_metadata.__name__:
        return False
    value = getattr(dcp_metadata, name, None)
    return isinstance(value, type) and value.__module__ == dcp_metadata.__name__


def _dtype(module: str, name: str) -> bool:
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class _MetadataUnpickler(pickle._Unpickler):  # the Python unpickler: its opcodes can be vetted
    """Builds only DCP's metadata objects: globals from a whitelist, and BUILD (setting an
    object's state) only on instances of DCP's own classes, never on a class (which would
    monkeypatch it for the whole process)."""

    dispatch: ClassVar[dict] = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or _metadata_class(module, name) or _dtype(module, name):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's checkpoint metadata")

    def load_build(self) -> None:
        target = self.stack[-2]  # BUILD: the object below its state
        kind = type(target)
        allowed = _metadata_class(kind.__module__, kind.__name__) or (
            (kind.__module__, kind.__name__) in _ALLOWED
        )
        if isinstance(target, type) or not allowed:
            raise pickle.UnpicklingError(f"setting the state of {target!r:.60} is refused")
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build


def read_dcp_metadata(path: Path) -> Any:
    """Unpickle a DCP `.metadata` file through the whitelist."""
    with open(path, "rb") as f:
        try:
            metadata = _MetadataUnpickler(f).load()
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointError(f"{path} refused: {err} (a crafted file?)") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise UnsafeCheckpointError(f"{path} refused: it holds a {type(metadata).__name__}")
    for info in (metadata.storage_data or {}).values():  # DCP opens these files
        name = os.path.normpath(str(getattr(info, "relative_path", "")))
        if os.path.isabs(name) or name.startswith(".."):
            raise UnsafeCheckpointError(
                f"{path} refused: it names {name!r}, outside the checkpoint"
            )
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file-system reader with a whitelisted unpickler for `.metadata`; `metadata`, when
    given, is that file already read (it is not unpickled a second time)."""

    def __init__(self, path: str, metadata: Any = None):
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        rank = kwargs.get("rank")
        if self._metadata is not None and rank is None:
            metadata = self._metadata
        else:
            name = METADATA if rank is None else f"__{rank}{METADATA}"
            metadata = read_dcp_metadata(Path(self.path) / name)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """Non-tensor items are read with `weights_only=True`; DCP's planner then reads the re-saved
    plain value (it always uses a full unpickler)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            plain = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            fqn = read_item.dest_index.fqn
            raise UnsafeCheckpointError(
                f"checkpoint item {fqn!r} refused: {unpickling_problem(err)}"
            ) from None
        again = io.BytesIO()
        torch.save(plain, again)
        again.seek(0)
        super().load_bytes(read_item, again)


def _numpy_arrays() -> list:
    """What a pickled numpy array of a plain dtype needs (checkpoints written before the RNG
    states were stored as tensors hold numpy's generator state as an array)."""
    return [np.ndarray(0).__reduce__()[0], np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_plain(path: Path) -> Any:
    """A `torch.save`d file of tensors and plain values (the trainer's own state)."""
    try:
        with torch.serialization.safe_globals(_numpy_arrays()):
            return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(f"{path} refused: {unpickling_problem(err)}") from None
