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
from safetensors.torch import load_file
from torch import Tensor

from model.hf.safetensors_stream import INDEX, StreamedFiles, TensorSpec

MAX_SHARD_BYTES = 5 * 2**30
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


Layout = list[tuple[str, tuple[int, ...]]]  # (HF name, shape) of every tensor a directory holds


def write_hf_dir(
    parts: dict[str, Tensor] | Iterable[dict[str, Tensor]],
    config: Callable[[torch.dtype], dict[str, Any]],
    out_dir: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    overwrite: bool = False,
    keep_fp32: tuple[str, ...] = (),
    layout: Layout | None = None,
) -> Path:
    """Write config(dtype) + the tensors (HF names) to `out_dir` atomically (a temporary sibling,
    then rename): one state dict, or parts of one streamed in turn with their `layout` and
    `dtype` given in advance (each tensor then goes to disk as it comes: model/hf/
    safetensors_stream.py). `dtype`: by default the state dict's first tensor's. Tensors whose
    names end with one of `keep_fp32` stay fp32 (a router's selection bias rounded to bf16
    would change which experts win near ties)."""
    if isinstance(parts, dict):
        dtype = dtype or next(iter(parts.values()), torch.empty(())).dtype
        layout = [(name, tuple(t.shape)) for name, t in parts.items()]
        parts = [parts]
    elif layout is None or dtype is None:
        raise ValueError("streamed parts need their layout and dtype in advance")
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} exists; pass overwrite=True or choose another directory")

    def stored(name: str) -> torch.dtype:
        return torch.float32 if name.endswith(keep_fp32) else dtype

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        specs = [TensorSpec(name, stored(name), shape) for name, shape in layout]
        writer = StreamedFiles(tmp, specs, max_shard_bytes)
        for part in parts:
            for name, tensor in part.items():
                writer.add(name, tensor.detach().to("cpu", stored(name)))
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


class HFWeights:
    """The safetensors weights of a Hugging Face directory, read a few tensors at a time: the
    files are memory-mapped while a group is open (`opened`), so a tensor costs memory only
    where it is read, and closing the group releases it."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        index = self.path / INDEX
        if index.is_file():
            self.file_of: dict[str, str] = _weight_map(index)
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


def _weight_map(index: Path) -> dict[str, str]:
    """An index's tensor -> file map; files must lie in the index's directory (as a data
    manifest's must: a crafted index would otherwise read any file the user can)."""
    try:
        file_of = json.loads(index.read_text())["weight_map"]
        if not all(isinstance(n, str) and isinstance(f, str) for n, f in file_of.items()):
            raise TypeError("weight_map is not names -> file names")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{index} is not a safetensors index ({err})") from None
    for filename in sorted(set(file_of.values())):
        normal = os.path.normpath(filename)
        if os.path.isabs(normal) or normal == ".." or normal.startswith(".." + os.sep):
            raise ValueError(
                f"{index} names {filename!r}, which lies outside its directory: refused (a "
                "shard index names the safetensors files beside it)"
            )
    return file_of


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
