"""Hugging Face model directories: `config.json` plus safetensors weights (one `model.safetensors`,
or shards with a `model.safetensors.index.json`), written atomically."""

from __future__ import annotations

import json
import os
import secrets
import shutil
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
    """Write config(dtype) + the tensors (HF names) to `out_dir` atomically (`staged_dir`):
    `write_hf_files` into a temporary sibling, then renamed into place."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir} exists; pass overwrite=True or choose another directory")
    with staged_dir(out_dir) as tmp:
        write_hf_files(
            parts,
            config,
            tmp,
            dtype=dtype,
            max_shard_bytes=max_shard_bytes,
            keep_fp32=keep_fp32,
            layout=layout,
        )
    return out_dir


def write_hf_files(
    parts: dict[str, Tensor] | Iterable[dict[str, Tensor]],
    config: Callable[[torch.dtype], dict[str, Any]],
    directory: Path,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    keep_fp32: tuple[str, ...] = (),
    layout: Layout | None = None,
) -> None:
    """Write config(dtype) + the tensors (HF names) into `directory`, which exists (a caller's
    temporary one): one state dict, or parts of one streamed in turn with their `layout` and
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

    def stored(name: str) -> torch.dtype:
        return torch.float32 if name.endswith(keep_fp32) else dtype

    specs = [TensorSpec(name, stored(name), shape) for name, shape in layout]
    writer = StreamedFiles(directory, specs, max_shard_bytes)
    for part in parts:
        for name, tensor in part.items():
            writer.add(name, tensor.detach().to("cpu", stored(name)))
        part = tensor = None  # before the next part is read
    writer.close()
    (directory / "config.json").write_text(json.dumps(config(dtype), indent=2) + "\n")


@contextmanager
def staged_dir(out_dir: Path) -> Iterator[Path]:
    """A temporary sibling of `out_dir` to write into, renamed to `out_dir` when the block ends
    without an error, removed whatever the error. A directory already at `out_dir` (the caller
    decided it may go) is moved aside first and deleted only once the new one is in place, so
    there is always a complete directory under one of the two names."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = _sibling(out_dir, "tmp")
    tmp.mkdir()  # not tempfile.mkdtemp: its mode 0700 would stay the export's
    old = None
    try:
        yield tmp
        if out_dir.exists() or out_dir.is_symlink():
            old = _sibling(out_dir, "old")
            out_dir.rename(old)
        tmp.rename(out_dir)
    except BaseException:
        if old is not None and not out_dir.exists():  # the last rename failed: the old one back
            old.rename(out_dir)
            old = None
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()


def _sibling(path: Path, what: str) -> Path:
    """An unused hidden name beside `path` (`.name.tmp-<pid>-<random>`)."""
    return path.with_name(f".{path.name}.{what}-{os.getpid()}-{secrets.token_hex(4)}")


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
