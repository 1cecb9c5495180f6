"""Hugging Face model directories: `config.json` plus safetensors weights (one `model.safetensors`,
or shards with a `model.safetensors.index.json`), written atomically."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

MAX_SHARD_BYTES = 5 * 2**30
INDEX = "model.safetensors.index.json"
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def write_hf_dir(
    parts: dict[str, Tensor] | Iterable[dict[str, Tensor]],
    config: Callable[[torch.dtype], dict[str, Any]],
    out_dir: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    overwrite: bool = False,
    keep_fp32: tuple[str, ...] = (),
) -> Path:
    """Write config(dtype) + the tensors (HF names: one state dict, or parts of one streamed
    in turn) to `out_dir` atomically (a temporary sibling, then rename). `dtype`: the first
    tensor's when None. Tensors whose names end with one of `keep_fp32` stay fp32 (a router's
    selection bias rounded to bf16 would change which experts win near ties)."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} exists; pass overwrite=True or choose another directory")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        writer = ShardWriter(tmp, max_shard_bytes)
        for part in [parts] if isinstance(parts, dict) else parts:
            for name, tensor in part.items():
                dtype = dtype or tensor.dtype
                kept = torch.float32 if name.endswith(keep_fp32) else dtype
                writer.add(name, tensor.detach().to("cpu", kept))
            part = tensor = None  # before the next part is read
        writer.close()
        (tmp / "config.json").write_text(json.dumps(config(dtype), indent=2) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


class ShardWriter:
    """Tensors (HF names) streamed into size-limited safetensors files in `directory`: a file is
    written as soon as the next tensor would take it past `max_shard_bytes`, so at most one
    file's tensors are held. `close()` names the files model-0000i-of-0000N.safetensors (one
    file: model.safetensors) and writes model.safetensors.index.json."""

    def __init__(self, directory: Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
        self.directory, self.max_shard_bytes = directory, max_shard_bytes
        self.pending: dict[str, Tensor] = {}
        self.pending_bytes = self.total_bytes = 0
        self.files: list[list[str]] = []  # the names in each written file

    def add(self, name: str, tensor: Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        save_file(self.pending, self._part(len(self.files)), metadata={"format": "pt"})
        self.files.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def _part(self, i: int) -> Path:
        return self.directory / f".part-{i:05d}.safetensors"

    def close(self) -> None:
        if self.pending or not self.files:
            self._flush()
        if len(self.files) == 1:
            self._part(0).rename(self.directory / "model.safetensors")
            return
        weight_map = {}
        for i, names in enumerate(self.files):
            filename = f"model-{i + 1:05d}-of-{len(self.files):05d}.safetensors"
            self._part(i).rename(self.directory / filename)
            weight_map.update(dict.fromkeys(names, filename))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")


class HFWeights:
    """The safetensors weights of a Hugging Face directory, read a few tensors at a time: the
    files are memory-mapped while a group is open (`opened`), so a tensor costs memory only
    where it is read, and closing the group releases it."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        index = self.path / INDEX
        if index.is_file():
            try:
                self.file_of: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ValueError(f"{index} is not a safetensors index ({err!r})") from None
        elif (self.path / "model.safetensors").is_file():
            with _open(self.path / "model.safetensors") as f:
                self.file_of = dict.fromkeys(f.keys(), "model.safetensors")
        else:
            raise FileNotFoundError(f"{self.path} has neither model.safetensors nor {INDEX}")

    def names(self) -> list[str]:
        return list(self.file_of)

    @contextmanager
    def opened(self, names: Iterable[str]) -> Iterator[dict[str, Tensor]]:
        """The tensors `names`, memory-mapped until the context closes."""
        by_file: dict[str, list[str]] = {}
        for name in names:
            by_file.setdefault(self.file_of[name], []).append(name)
        with ExitStack() as files:
            tensors = {}
            for filename, in_file in by_file.items():
                handle = files.enter_context(_open(self.path / filename))
                try:
                    tensors |= {name: handle.get_tensor(name) for name in in_file}
                except SafetensorError as err:  # e.g. an index naming the wrong file
                    raise ValueError(f"{self.path / filename} cannot be read: {err}") from None
            yield tensors


def _open(path: Path) -> Any:
    """safetensors' handle of `path`; a missing or damaged file is a ValueError naming it."""
    try:
        return safe_open(path, "pt")
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path} cannot be read: {err}") from None


def read_hf_state_dict(path: str | os.PathLike) -> dict[str, Tensor]:
    """Every tensor of a Hugging Face directory (memory-mapped)."""
    weights = HFWeights(path)
    state: dict[str, Tensor] = {}
    for filename in sorted(set(weights.file_of.values())):
        state.update(load_file(weights.path / filename))
    return state
